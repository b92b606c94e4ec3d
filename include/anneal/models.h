/* anneal models: the model interface (model.h: architectures, the registry, shared
 * evaluation and generation) and the architectures' own headers (GPT-2). */
#ifndef ANNEAL_MODELS_H
#define ANNEAL_MODELS_H

#include "anneal/model.h"
#include "anneal/gpt2.h"

#endif

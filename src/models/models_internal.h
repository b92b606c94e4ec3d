/* Shared by the files of src/models. */
#ifndef ANNEAL_MODELS_INTERNAL_H
#define ANNEAL_MODELS_INTERNAL_H

#include "anneal/model.h"

/* The library's own architectures (registry.c), NULL-ended. */
extern const anneal_model_arch *const anneal_builtin_archs[];

#endif

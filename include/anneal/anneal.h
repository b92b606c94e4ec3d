/* anneal: everything public. */
#ifndef ANNEAL_H
#define ANNEAL_H

#include "anneal/core.h"
#include "anneal/parse.h"
#include "anneal/trace.h"
#include "anneal/backend.h"
#include "anneal/cuda.h"
#include "anneal/autograd.h"
#include "anneal/ops.h"
#include "anneal/custom_op.h"
#include "anneal/io.h"
#include "anneal/peft.h"
#include "anneal/gguf.h"
#include "anneal/nn.h"
#include "anneal/onnx.h"
#include "anneal/parallel.h"
#include "anneal/optim.h"
#include "anneal/models.h"
#include "anneal/data.h"
#include "anneal/checkpoint.h"
#include "anneal/obs.h"
#include "anneal/telemetry.h"
#include "anneal/profile.h"
#include "anneal/train.h"
#include "anneal/serve.h"

#endif

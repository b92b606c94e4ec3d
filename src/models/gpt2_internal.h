/* GPT-2 internals shared by the training forward (gpt2.c) and the cached
 * generation forward (gpt2_generate.c): one block with a pluggable attention. */
#ifndef ANNEAL_MODELS_GPT2_INTERNAL_H
#define ANNEAL_MODELS_GPT2_INTERNAL_H

#include "anneal/models.h"

/* Attention of a block from its fused qkv (B, T, 3C) to (B, T, C). */
typedef anneal_tensor *(*anneal_gpt2_attend_fn)(void *ctx, int layer, anneal_tensor *qkv);

/* One pre-LN block of layer `layer` on x (B, T, C). attend NULL: causal self-attention
 * over x's own positions (training); otherwise attend(ctx, layer, qkv) (e.g. a KV cache). */
anneal_tensor *anneal_gpt2_block_apply(const anneal_gpt2_block *b, int layer, anneal_tensor *x,
                                       anneal_gpt2_attend_fn attend, void *ctx);

#endif

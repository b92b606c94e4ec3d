/* anneal nn: named parameters (Hugging Face compatible names) held in one
 * long-lived scope, and the building blocks models are written with. */
#ifndef ANNEAL_NN_H
#define ANNEAL_NN_H

#include "anneal/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the forward passes of a model's blocks run with: the matrix-product precision
 * (see anneal_dense) and whether dropout is on. Models hold one and hand it to their
 * blocks; there is no global or thread-local setting. */
typedef struct anneal_nn_ctx {
    anneal_dtype compute; /* ANNEAL_F32 (0), ANNEAL_BF16 or ANNEAL_F16 */
    bool training;        /* dropout on */
} anneal_nn_ctx;

/* One trainable tensor with its hierarchical name ("transformer.h.0.ln_1.weight"). */
typedef struct anneal_param {
    char *name;
    anneal_tensor *tensor; /* f32 leaf, requires_grad */
    bool decay;            /* receives weight decay (matmul weights, not biases/norms/embeddings) */
} anneal_param;

/* The parameters of a model, in registration order, owning their tensors. */
typedef struct anneal_params {
    int n, cap;
    anneal_param *items;
    anneal_scope *scope; /* holds every parameter tensor */
} anneal_params;

/* Empty parameter set (NULL + error on OOM). */
anneal_params *anneal_params_new(void);
/* Frees the set and every parameter tensor (and its grad). */
void anneal_params_free(anneal_params *ps);
/* Creates an f32 parameter of `shape` named `name` (zero-filled), registers it, marks
 * it requires_grad. Fails on a duplicate name. */
anneal_tensor *anneal_params_create(anneal_params *ps, const char *name, int ndim,
                                    const int64_t *shape, bool decay);
/* The parameter called name, or NULL (no error recorded). */
anneal_param *anneal_params_find(const anneal_params *ps, const char *name);
/* Total number of elements over all parameters. */
int64_t anneal_params_numel(const anneal_params *ps);
/* Drops every gradient (set to none). */
void anneal_params_zero_grad(anneal_params *ps);

/* In-place initialisers (no autograd), drawing from the global Philox generator. */
anneal_status anneal_init_normal_(anneal_tensor *t, float mean, float std);
anneal_status anneal_init_fill_(anneal_tensor *t, float value);

#ifdef __cplusplus
}
#endif
#endif

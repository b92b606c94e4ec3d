/* Helpers shared by the nn blocks. */
#ifndef ANNEAL_NN_INTERNAL_H
#define ANNEAL_NN_INTERNAL_H

#include "anneal/nn.h"

/* Longest parameter name a block registers. */
#define ANNEAL_NN_NAME_MAX 256

/* "<prefix>.<name>" (just name for an empty prefix) into buf; false + ANNEAL_ERR_ARG
 * naming what when name is NULL or the result does not fit. */
bool anneal_nn_name(char *buf, size_t n, const char *what, const char *prefix, const char *name);

/* Registers "<prefix>.<suffix>" (just suffix for an empty prefix) of the shape in ps;
 * NULL + an error naming the parameter when the name does not fit or creation fails. */
anneal_tensor *anneal_nn_param(anneal_params *ps, const char *prefix, const char *suffix, int ndim,
                               const int64_t *shape, bool decay);

/* The forward of a dense layer with an active quant record (quant.c): the int8 product,
 * then the activation as its own op. */
anneal_tensor *anneal_nn_quant_forward(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                       anneal_activation act, anneal_tensor *mul);

/* pre, then act as its own op (activation.c): GELU (tanh), or SiLU(pre) * mul. */
anneal_tensor *anneal_nn_act_unfused(anneal_tensor *pre, anneal_activation act, anneal_tensor *mul);

/* The forward of a dense layer packed as bf16 panels (packed.c): anneal_panels_linear,
 * then the activation as its own op. */
anneal_tensor *anneal_nn_packed_forward(const anneal_nn_dense *d, anneal_tensor *x, anneal_activation act,
                                        anneal_tensor *mul);

/* anneal_nn_dense_forward_act with the layer's x_kept_f32 (anneal_dense_opts): true
 * when x is saved in f32 by another op anyway, so a bf16 copy would only add bytes. */
anneal_tensor *anneal_nn_dense_forward_kept(const anneal_nn_dense *d, const anneal_nn_ctx *ctx, anneal_tensor *x,
                                            anneal_activation act, anneal_tensor *mul, bool x_kept_f32);

/* Replaces the f32 weight parameter of pd by a stride-0 view of one zero of its shape,
 * frozen (params.c): for a layer whose weight now lives in another form (int8, bf16
 * panels) that is all that reads it. */
anneal_status anneal_nn_release_weight(anneal_params *ps, anneal_params_dense *pd);

/* Calibration: adds x's values to d's statistics (the forward then runs f32). */
anneal_status anneal_nn_quant_observe(const anneal_nn_dense *d, anneal_tensor *x);

#endif

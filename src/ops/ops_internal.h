/* Helpers shared by the op families: argument checks that record clear errors,
 * backend lookup, broadcasting and reducing a gradient back to an input's shape. */
#ifndef ANNEAL_OPS_INTERNAL_H
#define ANNEAL_OPS_INTERNAL_H

#include "anneal/autograd.h"
#include "anneal/backend.h"
#include "anneal/ops.h"

/* Backend for the inputs of op `name` (all non-NULL inputs on one device), or NULL:
 * silently when an input is NULL (an earlier error), with an error otherwise. */
const anneal_backend *anneal_ops_backend(const char *name, int n, anneal_tensor *const *inputs);
/* True when t is f32; records ANNEAL_ERR_DTYPE naming op and argument otherwise. */
bool anneal_ops_require_f32(const char *op, const char *arg, const anneal_tensor *t);
/* True when t's dtype is i32; records ANNEAL_ERR_DTYPE otherwise. */
bool anneal_ops_require_i32(const char *op, const char *arg, const anneal_tensor *t);
/* Normalises a possibly negative dim for a rank-ndim tensor; -1 + error if out of range. */
int anneal_ops_dim(const char *op, int dim, int ndim);
/* NumPy broadcast of two shapes into out (ndim written); false + ANNEAL_ERR_SHAPE if incompatible. */
bool anneal_ops_broadcast_shape(const char *op, const anneal_tensor *a, const anneal_tensor *b,
                                int *ndim, int64_t *shape);
/* View of t expanded to (ndim, shape) with stride 0 in broadcast dims (no autograd). */
anneal_tensor *anneal_ops_expand(const anneal_tensor *t, int ndim, const int64_t *shape);
/* Sums gradient g (broadcast shape) down to (ndim, shape) (no autograd). */
anneal_tensor *anneal_ops_sum_to(const anneal_tensor *g, int ndim, const int64_t *shape);
/* A contiguous version of t without recording autograd (t itself if contiguous). */
anneal_tensor *anneal_ops_contiguous_raw(anneal_tensor *t);
/* Writes "[i, j, k]", the multi-index of row-major position pos in t's shape. */
const char *anneal_ops_index_str(const anneal_tensor *t, int64_t pos, char *buf, size_t n);
/* The numel(t) elements (elem bytes each) of contiguous t readable on the host: t's own
 * data on the CPU, else a malloc'd copy stored in *owned (the caller frees it). NULL +
 * error on failure. */
const void *anneal_ops_host_view(const anneal_backend *be, const anneal_tensor *t, size_t elem,
                                 void **owned);
/* The class targets of a loss (contiguous i32 tc) on the host, after checking each is
 * ignore_index or in [0, V) (else NULL + an error naming op, the value and its
 * position); *count = the targets that are not ignored. As anneal_ops_host_view, a copy
 * may be stored in *owned for the caller to free. */
const int32_t *anneal_ops_check_targets(const char *op, const anneal_backend *be, const anneal_tensor *tc,
                                        int64_t V, int32_t ignore_index, int64_t *count, void **owned);
/* New contiguous f32 tensor with t's shape on t's device. */
anneal_tensor *anneal_ops_new_like(const anneal_tensor *t);

#endif

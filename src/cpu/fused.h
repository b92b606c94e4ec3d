/* The CPU backend's fused kernels (issue 5): tensor-level entry points for the
 * backend table slots add_layer_norm_fwd/bwd and linear_cross_entropy (see
 * include/anneal/backend.h for what each promises; the dense layer's bias + GELU is
 * the matmul slot's epilogue). linear_cross_entropy takes the dlogits factor g
 * already formed from the kept-row count. */
#ifndef ANNEAL_CPU_FUSED_H
#define ANNEAL_CPU_FUSED_H

#include "anneal/backend.h"

anneal_status anneal_cpu_add_layer_norm_fwd(anneal_tensor *s, anneal_tensor *y, anneal_tensor *mean,
                                            anneal_tensor *rstd, const anneal_tensor *x,
                                            const anneal_tensor *r, const anneal_tensor *w,
                                            const anneal_tensor *b, float eps);
anneal_status anneal_cpu_add_layer_norm_bwd(anneal_tensor *dx, anneal_tensor *dw, anneal_tensor *db,
                                            const anneal_tensor *s, const anneal_tensor *w,
                                            const anneal_tensor *mean, const anneal_tensor *rstd,
                                            const anneal_tensor *dy, const anneal_tensor *ds);
anneal_status anneal_cpu_linear_cross_entropy(anneal_tensor *loss, anneal_tensor *lse,
                                              anneal_tensor *dh, anneal_tensor *dw,
                                              anneal_tensor *work, const anneal_tensor *h,
                                              const anneal_tensor *w, const anneal_tensor *targets,
                                              int32_t ignore_index, float scale,
                                              anneal_dtype compute);

#endif

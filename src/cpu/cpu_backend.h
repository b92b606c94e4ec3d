/* The CPU backend's tensor-level kernels (what its anneal_backend table's slots call,
 * cpu_backend.c). Raw-buffer kernels are in cpu_kernels.h. */
#ifndef ANNEAL_CPU_BACKEND_H
#define ANNEAL_CPU_BACKEND_H

#include "anneal/backend.h"

anneal_status anneal_cpu_copy(anneal_tensor *dst, const anneal_tensor *src);
anneal_status anneal_cpu_fill(anneal_tensor *dst, double value);
anneal_status anneal_cpu_binary(anneal_binary_op op, anneal_tensor *out, const anneal_tensor *a,
                                const anneal_tensor *b);
anneal_status anneal_cpu_unary(anneal_unary_op op, anneal_tensor *out, const anneal_tensor *x,
                               float alpha);
anneal_status anneal_cpu_unary_bwd(anneal_unary_op op, anneal_tensor *dx, const anneal_tensor *x,
                                   const anneal_tensor *dy, float alpha);
anneal_status anneal_cpu_reduce_sum(anneal_tensor *out, const anneal_tensor *x);
anneal_status anneal_cpu_dropout_fwd(anneal_tensor *y, anneal_tensor *mask, const anneal_tensor *x,
                                     float p, uint64_t seed, uint64_t offset);
anneal_status anneal_cpu_dropout_bwd(anneal_tensor *dx, const anneal_tensor *mask,
                                     const anneal_tensor *dy, float p);
anneal_status anneal_cpu_randn(anneal_tensor *x, float mean, float std, uint64_t seed,
                               uint64_t offset);

/* Registers the CPU table (listed in src/backends/registry.c, which core calls on the
 * first lookup of a device). */
anneal_status anneal_cpu_backend_register(void);

#endif

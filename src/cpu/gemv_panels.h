/* The bf16 panel GEMM behind anneal_gemv (src/cpu/gemv_panels.c), internal to the CPU
 * backend: gemv.c dispatches weights with .bf16_panels here. */
#ifndef ANNEAL_CPU_GEMV_PANELS_H
#define ANNEAL_CPU_GEMV_PANELS_H

#include "anneal/decode_kernels.h"

/* y[r, j] = act(sum_k x[r, k] W[j, k] + bias[j]) for r < n (any n >= 1) over a weight
 * packed by anneal_gemv_pack_panels_bf16; each element one f32 FMA chain in increasing
 * k, so the bits do not depend on n, the thread count or the path. */
void anneal_gemv_panels(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                        int act);

#endif

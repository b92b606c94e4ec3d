/* Dense layer + bias + tanh-GELU as one GEMM: the bias add and the GELU run in the
 * GEMM's epilogue while each output tile is still in cache, which also stores the
 * pre-activation the backward needs. So the (R, N) activation is written twice (pre
 * and y) and never re-read, instead of GEMM -> bias pass -> GELU pass. */
#include "cpu/fused.h"
#include "cpu/cpu_kernels.h"

/* y (R, N) = gelu_tanh(x (R, K) @ w (K, N) + b), pre = x @ w + b; all row-major. */
anneal_status anneal_cpu_dense_gelu_fwd(anneal_tensor *y, anneal_tensor *pre, const anneal_tensor *x,
                                        const anneal_tensor *w, const anneal_tensor *b,
                                        anneal_dtype compute) {
    int64_t R = x->shape[0], K = x->shape[1], N = w->shape[1];
    anneal_gemm_epilogue ep = {.bias = b ? anneal_data(b) : NULL, .gelu_tanh = true,
                               .pre = anneal_data(pre)};
    anneal_cpu_gemm((int)compute, false, false, R, N, K, 1.0f, anneal_data(x), K > 0 ? K : 1,
                    anneal_data(w), N > 0 ? N : 1, 0.0f, anneal_data(y), N > 0 ? N : 1, &ep);
    return ANNEAL_OK;
}

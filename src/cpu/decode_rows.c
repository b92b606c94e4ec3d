/* Row operations of a decode step (decode_kernels.h): the CPU kernels the tensor path
 * runs (norm.c, pointwise.c), row by row, so a decode step's norms and activations are
 * the tensor path's bits for the same inputs. */
#include "anneal/decode_kernels.h"
#include "cpu/cpu_kernels.h"

void anneal_decode_layer_norm(int64_t n, int64_t C, const float *x, const float *w, const float *b, float eps,
                              float *y) {
    for (int64_t i = 0; i < n; i++) {
        float mean, rstd;
        anneal_cpu_layer_norm_fwd(1, C, x + i * C, w, b, eps, y + i * C, &mean, &rstd);
    }
}

void anneal_decode_rms_norm(int64_t n, int64_t C, const float *x, const float *w, float eps, float *y) {
    for (int64_t i = 0; i < n; i++) {
        float rstd;
        anneal_cpu_rms_norm_fwd(1, C, x + i * C, w, eps, y + i * C, &rstd);
    }
}

void anneal_decode_gelu_tanh(int64_t n, float *x) { anneal_cpu_gelu_fwd(n, x, x, true); }

void anneal_decode_silu_mul(int64_t n, float *g, const float *u) {
    anneal_cpu_silu_fwd(n, g, g);
    for (int64_t i = 0; i < n; i++) g[i] *= u[i];
}

/* AdamW step and the sum of squares used for gradient-norm clipping.
 * The AdamW update repeats PyTorch 1.13's _single_tensor_adamw operation by
 * operation (same float roundings in the same order, scalars formed in double
 * from double hyperparameters and rounded to float, as PyTorch does), so parameters track a
 * PyTorch run to the last bit or so. OpenMP over fixed element blocks; the
 * multi-tensor form updates all parameters in one parallel pass. */
#include "anneal/backend.h"
#include "cpu/cpu_kernels.h"
#include "cpu/vec_math.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

#define ADAMW_BLOCK 8192          /* elements per OpenMP work item */
#define ADAMW_PARALLEL_MIN 32768  /* below this one thread does the whole call */
#define ADAMW_SUB 64              /* elements per inner pass (three L1-resident arrays) */
#define SS_MAX_CHUNKS 256         /* sum_squares: at most this many fixed partials */
#define SS_MIN_CHUNK 65536        /* and at least this many elements in each */

/* The scalars of one step, rounded to float where PyTorch rounds them. */
typedef struct {
    float decay;     /* 1 - lr*wd            (param.mul_) */
    float beta1;     /* exp_avg.mul_(beta1) */
    float omb1;      /* 1 - beta1            (add_ alpha) */
    float beta2;     /* exp_avg_sq.mul_(beta2) */
    float omb2;      /* 1 - beta2            (addcmul_ value) */
    float bc2_sqrt;  /* sqrt(bc2)            (the divisor of exp_avg_sq.sqrt()) */
    float eps;
    float neg_step;  /* -lr / bc1            (addcdiv_ value) */
} adamw_scalars;

/* out = sqrt(in), correctly rounded like sqrtf. A sqrtf loop is not vectorised while
 * errno is honoured (gcc's default), so x86 uses the SSE sqrtps (baseline on x86-64;
 * VEX-encoded in the AVX clones). */
ANNEAL_INLINE void sqrt_array(int64_t n, const float *restrict in, float *restrict out) {
    int64_t i = 0;
#if defined(__SSE__)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(out + i, _mm_sqrt_ps(_mm_loadu_ps(in + i)));
#endif
    for (; i < n; i++) out[i] = sqrtf(in[i]);
}

/* p, m, v updated in place over n elements, as PyTorch's vectorised CPU kernels
 * compute each op (checked bitwise against torch 1.13 on an AVX-512 machine):
 *   p = p * decay                                   mul_
 *   m = fma(omb1, g, m * beta1)                     mul_, add_(alpha): vec::fmadd
 *   v = fma(omb2 * g, g, v * beta2)                 mul_, addcmul_ (contracted)
 *   denom = sqrt(v) / bc2_sqrt + eps                sqrt, div, add_
 *   p = p + (neg_step * m) / denom                  addcdiv_
 * fmaf is one instruction in the AVX-512 and AVX2 clones (a libm call otherwise).
 * Works in ADAMW_SUB pieces so the sqrt can run as its own vector pass. */
ANNEAL_VEC_CLONES
static void adamw_block(int64_t n, float *restrict p, const float *restrict g, float *restrict m,
                        float *restrict v, adamw_scalars s) {
    float root[ADAMW_SUB];
    for (int64_t i0 = 0; i0 < n; i0 += ADAMW_SUB) {
        int64_t len = n - i0 < ADAMW_SUB ? n - i0 : ADAMW_SUB;
        float *pb = p + i0, *mb = m + i0, *vb = v + i0;
        const float *gb = g + i0;
        for (int64_t i = 0; i < len; i++) {
            float gi = gb[i];
            mb[i] = fmaf(s.omb1, gi, mb[i] * s.beta1);
            vb[i] = fmaf(s.omb2 * gi, gi, vb[i] * s.beta2);
        }
        sqrt_array(len, vb, root);
        for (int64_t i = 0; i < len; i++) {
            float denom = root[i] / s.bc2_sqrt + s.eps;
            pb[i] = pb[i] * s.decay + s.neg_step * mb[i] / denom;
        }
    }
}

/* The float constants of one parameter's step, rounded as PyTorch rounds them. */
static adamw_scalars make_scalars(double lr, double beta1, double beta2, double eps,
                                  double weight_decay, double bc1, double bc2) {
    return (adamw_scalars){
        .decay = (float)(1.0 - lr * weight_decay),
        .beta1 = (float)beta1,
        .omb1 = (float)(1.0 - beta1),
        .beta2 = (float)beta2,
        .omb2 = (float)(1.0 - beta2),
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = (float)eps,
        .neg_step = (float)(-(lr / bc1)),
    };
}

/* One AdamW step over n elements; bc1 = 1 - beta1^t, bc2 = 1 - beta2^t. */
void anneal_cpu_adamw(int64_t n, float *p, const float *g, float *m, float *v, double lr,
                      double beta1, double beta2, double eps, double weight_decay, double bc1,
                      double bc2) {
    adamw_scalars s = make_scalars(lr, beta1, beta2, eps, weight_decay, bc1, bc2);
    int64_t nb = (n + ADAMW_BLOCK - 1) / ADAMW_BLOCK;
#pragma omp parallel for schedule(static) if (n >= ADAMW_PARALLEL_MIN)
    for (int64_t b = 0; b < nb; b++) {
        int64_t i0 = b * ADAMW_BLOCK;
        int64_t len = n - i0 < ADAMW_BLOCK ? n - i0 : ADAMW_BLOCK;
        adamw_block(len, p + i0, g + i0, m + i0, v + i0, s);
    }
}

/* AdamW over every group in one parallel region. The groups' elements are seen as
 * one concatenated range of N; thread k of nt updates [N*k/nt, N*(k+1)/nt), walking
 * the groups that range crosses. Every element gets the same arithmetic as in
 * anneal_cpu_adamw (adamw_block is elementwise), so the result is bit-identical
 * whatever the split; one region instead of one per parameter saves the fork/join
 * and the load imbalance of ~150 small parameters. */
void anneal_cpu_adamw_multi(const anneal_adamw_group *groups, int n, double lr, double beta1,
                            double beta2, double eps) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += groups[i].numel;
    if (total <= 0) return;
#pragma omp parallel if (total >= ADAMW_PARALLEL_MIN)
    {
        int nt = omp_get_num_threads(), k = omp_get_thread_num();
        int64_t lo = (int64_t)((__int128)total * k / nt), hi = (int64_t)((__int128)total * (k + 1) / nt);
        int64_t base = 0; /* first element of group i in the concatenation */
        for (int i = 0; i < n && base < hi; base += groups[i].numel, i++) {
            const anneal_adamw_group *gr = &groups[i];
            int64_t a = lo > base ? lo - base : 0, b = hi - base < gr->numel ? hi - base : gr->numel;
            if (b <= a) continue;
            adamw_scalars s = make_scalars(lr, beta1, beta2, eps, gr->weight_decay, gr->bc1, gr->bc2);
            adamw_block(b - a, gr->p + a, gr->g + a, gr->m + a, gr->v + a, s);
        }
    }
}

/* sum(x^2) over n floats in double, 8 fixed lanes combined as a pairwise tree. */
ANNEAL_VEC_CLONES
static double sum_squares_chunk(int64_t n, const float *restrict x) {
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
    for (int j = 0; i + j < n; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* Sum of squares: n is cut into at most SS_MAX_CHUNKS chunks whose size depends on n
 * only; the chunk partials are added in chunk order, so the result is the same for
 * any thread count. */
double anneal_cpu_sum_squares(int64_t n, const float *x) {
    if (n <= 0) return 0.0;
    int64_t chunk = (n + SS_MAX_CHUNKS - 1) / SS_MAX_CHUNKS;
    chunk = chunk < SS_MIN_CHUNK ? SS_MIN_CHUNK : (chunk + 15) / 16 * 16;
    int64_t nc = (n + chunk - 1) / chunk;
    double part[SS_MAX_CHUNKS];
#pragma omp parallel for schedule(static) if (nc > 1)
    for (int64_t k = 0; k < nc; k++) {
        int64_t i0 = k * chunk;
        part[k] = sum_squares_chunk(n - i0 < chunk ? n - i0 : chunk, x + i0);
    }
    double total = 0.0;
    for (int64_t k = 0; k < nc; k++) total += part[k];
    return total;
}

/* Rotary position embedding (RoPE) on the CPU, with Hugging Face Llama semantics
 * (transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb), in place on a strided
 * (B, H, T, D) view.
 *
 * Pairing is rotate_half's: dim i < D/2 pairs with i + D/2 (not adjacent dims). With
 * c = cos(a), s = sin(a), a = pos * inv_freq[i], pos = pos0 + t:
 *   forward   x'[i] = x[i] c - x[i + D/2] s,   x'[i + D/2] = x[i + D/2] c + x[i] s
 *   inverse   x'[i] = x[i] c + x[i + D/2] s,   x'[i + D/2] = x[i + D/2] c - x[i] s
 * (the inverse is the rotation by -a, i.e. the transpose of the forward with the same
 * c and s: the backward of the forward, and exactly its adjoint).
 *
 * Float arithmetic, operation by operation as transformers does it in float32 (so what
 * is exact is exact and the rest is within an ulp):
 *   inv_freq[i] = 1 / theta^(float(2i) / D)        f32 division, f32 powf, f32 division
 *   linear      inv_freq[i] / factor              (transformers: inv_freq /= factor)
 *   llama3      _compute_llama3_parameters with its float32 tensor operations (below)
 *   a           = float(pos) * inv_freq[i]        one f32 product (torch: a K = 1 matmul)
 *   c, s        = cosf(a), sinf(a)
 *   x'          = (x[i] * c) + (rotate_half(x)[i] * s): two f32 products and one sum,
 *                 each rounded (no FMA), as torch's three elementwise kernels.
 * Exact (bit-identical to PyTorch given the same inv_freq, c and s): the exponent, the
 * divisions and products, the llama3 arithmetic, the angle and the rotation. Not exact:
 * powf, cosf and sinf (glibc) against PyTorch's vectorised SLEEF pow/cos/sin (both
 * within 1 ulp of the true value, so they may differ by 1 ulp); a 1-ulp inv_freq
 * difference moves the angle by up to |a| 2^-23, which at large positions dominates
 * (|a| ~ 1e4 gives ~1e-3 in c and s, as PyTorch's own float32 angles carry). */
#include "cpu/cpu_kernels.h"

#include <math.h>
#include <stdlib.h>

enum {
    ROPE_STACK_PAIRS = 1024, /* inv_freq on the stack up to D = 2048 (malloc beyond) */
    ROPE_CHUNK = 64,         /* pairs whose cos/sin one work item computes at a time */
};

#define ROPE_TWO_PI_F32 6.28318548f /* float(2 * math.pi), as torch casts the scalar */

/* inv_freq[i] for i < D/2 (see the file comment and cpu_kernels.h). */
void anneal_cpu_rope_inv_freq(const anneal_cpu_rope_desc *d, float *inv_freq) {
    const int64_t half = d->D / 2;
    const float D = (float)d->D;
    /* llama3 constants: Python doubles from the config, compared / combined with float32
     * tensors, which casts them to float32 */
    const double omp = (double)d->original_max_pos;
    const float low_wavelen = (float)(omp / (double)d->low_freq_factor);
    const float high_wavelen = (float)(omp / (double)d->high_freq_factor);
    const float band = (float)((double)d->high_freq_factor - (double)d->low_freq_factor);
    for (int64_t i = 0; i < half; i++) {
        /* torch.arange(0, dim, 2).float() / dim; base ** that; 1.0 / that */
        const float e = (float)(2 * i) / D;
        float f = 1.0f / powf(d->theta, e);
        if (d->scaling == ANNEAL_CPU_ROPE_LINEAR) {
            f = f / d->factor;
        } else if (d->scaling == ANNEAL_CPU_ROPE_LLAMA3) {
            /* wavelen = 2 * math.pi / inv_freq: torch's scalar / tensor is
             * tensor.reciprocal() * scalar */
            const float wavelen = (1.0f / f) * ROPE_TWO_PI_F32;
            /* inv_freq_llama = where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq) */
            const float fl = wavelen > low_wavelen ? f / d->factor : f;
            /* smooth = (old_context_len / wavelen - low_freq_factor) / (high - low) */
            const float smooth =
                ((1.0f / wavelen) * (float)d->original_max_pos - d->low_freq_factor) / band;
            /* (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama */
            const float smoothed = (1.0f - smooth) * fl / d->factor + smooth * fl;
            const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
            f = medium ? smoothed : fl;
        }
        inv_freq[i] = f;
    }
}

/* Rotates pairs [i0, i0 + n) of one row (x at the row, h = D/2) by c, s (n values, for
 * those pairs; the inverse passes -sin, which is exact: b * (-s) = -(b * s)). */
static inline void rotate_row(float *x, int64_t h, int64_t i0, int n, const float *c,
                              const float *s) {
    float *lo = x + i0, *hi = x + h + i0;
    for (int j = 0; j < n; j++) {
        const float a = lo[j], b = hi[j];
        lo[j] = a * c[j] - b * s[j];
        hi[j] = b * c[j] + a * s[j];
    }
}

/* In-place RoPE (see cpu_kernels.h). Work items are (t, chunk of ROPE_CHUNK pairs): each
 * computes its cos/sin once and applies them to the B*H rows at that t, so cosf/sinf run
 * T * D/2 times whatever B*H is. Every element is computed by one item with no
 * reduction: the bits do not depend on the thread count. */
void anneal_cpu_rope(const anneal_cpu_rope_desc *d, float *x, int64_t pos0, bool inverse) {
    const int64_t B = d->B, H = d->H, T = d->T, h = d->D / 2;
    if (B <= 0 || H <= 0 || T <= 0 || h <= 0 || d->D % 2 != 0) return;
    float stack[ROPE_STACK_PAIRS];
    float *inv = h <= ROPE_STACK_PAIRS ? stack : malloc(sizeof(float) * (size_t)h);
    if (!inv) { /* out of memory: NaN, as errors propagate */
        for (int64_t b = 0; b < B; b++)
            for (int64_t hh = 0; hh < H; hh++)
                for (int64_t t = 0; t < T; t++)
                    for (int64_t i = 0; i < d->D; i++)
                        x[b * d->sb + hh * d->sh + t * d->st + i] = NAN;
        return;
    }
    anneal_cpu_rope_inv_freq(d, inv);
    const int64_t nchunks = (h + ROPE_CHUNK - 1) / ROPE_CHUNK, items = T * nchunks;
    const int64_t rows = B * H;
#pragma omp parallel for schedule(static) if (items > 1 && rows * T * d->D >= 16384)
    for (int64_t it = 0; it < items; it++) {
        const int64_t t = it / nchunks, i0 = it % nchunks * ROPE_CHUNK;
        const int n = h - i0 < ROPE_CHUNK ? (int)(h - i0) : ROPE_CHUNK;
        const float pos = (float)(pos0 + t);
        float c[ROPE_CHUNK], s[ROPE_CHUNK];
        for (int j = 0; j < n; j++) {
            const float a = pos * inv[i0 + j];
            c[j] = cosf(a);
            s[j] = inverse ? -sinf(a) : sinf(a);
        }
        for (int64_t r = 0; r < rows; r++)
            rotate_row(x + r / H * d->sb + r % H * d->sh + t * d->st, h, i0, n, c, s);
    }
    if (inv != stack) free(inv);
}

/* CPU kernels of token-by-token decoding (the backends layer; src/cpu/gemv.c and
 * src/cpu/decode_attention.c): a GEMV / skinny GEMM for a few rows over f32 or bf16
 * weights, streamed once per call and split over the output columns between threads,
 * and the attention of one new token per KV-cache slot reading the cache's stored dtype
 * (f32, bf16 or int8) directly. The decode engine (src/models/decode_engine.c) runs a
 * model's decode step with them; nothing here allocates but the int8 product's
 * workspace. */
#ifndef ANNEAL_DECODE_KERNELS_H
#define ANNEAL_DECODE_KERNELS_H

#include "anneal/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A weight matrix as the GEMV reads it. */
typedef struct anneal_gemv_weight {
    const void *w;     /* f32, bf16 (ANNEAL_BF16: raw uint16 bf16 values) or int8 (ANNEAL_I8) */
    anneal_dtype dtype;
    bool out_in;       /* true: W is (out, in) row-major (torch Linear); false: (in, out) (GPT-2 Conv1D);
                        * int8 weights are always (out, in) */
    int64_t in, out;
    const float *bias; /* (out) f32, or NULL */
    bool bf16_pairs;   /* bf16 (out, in) only: each row's whole 16-chunks in anneal_gemv_pair_bf16's
                        * order (cheaper to widen; the same sums, so the same bits) */
    bool bf16_panels;  /* bf16 packed by anneal_gemv_pack_panels_bf16 (out_in ignored): the panel
                        * GEMM, each element one FMA chain in k order (other bits than the
                        * (out, in) kernels', the same for every n, thread count and path) */
    /* int8 weights only: the quantized dense product of the tensor path, same kernel */
    anneal_quant_mode qmode;   /* WEIGHT_ONLY, DYNAMIC or STATIC */
    anneal_dtype qcompute;     /* weight-only: ANNEAL_F32 or ANNEAL_BF16 (x rounded to bf16) */
    int64_t qgroup;            /* weight-only group size, 0: one scale per output row */
    const float *qscale;       /* (out) or (out, in / qgroup) */
    float qact_scale;          /* static: the activations' scale */
    const int8_t *qpanels;     /* dynamic/static: the weight packed by anneal_gemv_pack_qpanels, or NULL:
                                * 2 or more rows then take the panel kernel (the same bits) */
} anneal_gemv_weight;

/* Epilogues of anneal_gemv. */
enum {
    ANNEAL_GEMV_NONE = 0,
    ANNEAL_GEMV_GELU_TANH = 1, /* 0.5 y (1 + tanh(sqrt(2/pi) (y + 0.044715 y^3))) */
};

/* int8 weights (dtype ANNEAL_I8) run the CPU backend's quantized dense product on the n
 * rows (the tensor path's kernel, so the same bits as there), then act; it allocates its
 * workspace and returns false when it cannot (true otherwise, and for every other dtype).
 * y[r, j] = act(sum_k x[r, k] W[k, j] + bias[j]) for r < n rows (any n >= 1; 1..16 is what
 * it is made for), x rows ldx floats apart, y rows ldy apart. Each output element is one
 * f32 sum over k in increasing k order (fused multiply-adds; OUT_IN: 16 partial sums over
 * k mod 16 added at the end), bf16 weights widened exactly to f32, so results do not
 * depend on the thread count. Threads (OpenMP, anneal_set_num_threads) take contiguous
 * ranges of output columns: each weight is read from memory once per call. */
bool anneal_gemv(const anneal_gemv_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                 int act);
/* The path anneal_gemv takes now: "avx512", "avx2" or "portable" (ANNEAL_CPU_ISA can
 * force a lower one; every x86 path gives the same bits). */
const char *anneal_gemv_path_name(void);

/* Reorders rows x in bf16 values (rows of `in`) in place for .bf16_pairs: in each whole
 * chunk of 16 at k, 32-bit word l (l < 8) holds w[k + l] in its low half and w[k + 8 + l]
 * in its high half; the last in % 16 values of a row stay as they are. */
void anneal_gemv_pair_bf16(uint16_t *w, int64_t rows, int64_t in);

/* Panel packing for .bf16_panels (src/cpu/gemv_panels.c): the output columns in panels
 * of 16, the last zero-padded; panel p holds `in` steps of 16 bf16 values (columns 16 p
 * ..), step k's 32-bit word l (l < 8) = column l in its low half, column 8 + l in its
 * high half; panels one after another. src is f32 (out, in) when out_in, else (in, out);
 * values rounded as anneal_gemv_to_bf16. dst holds anneal_gemv_panels_bf16_len(in, out)
 * values (64-byte aligned is best). */
int64_t anneal_gemv_panels_bf16_len(int64_t in, int64_t out);
void anneal_gemv_pack_panels_bf16(const float *src, bool out_in, int64_t in, int64_t out, uint16_t *dst);

/* Panel packing for .qpanels: an int8 (out, in) weight's rows in panels of 16, for the
 * int8 kernel of 2 or more rows, in the layout of this CPU's int8 path (VPDPBUSD quads,
 * src/cpu/qpanels_avx512vnni.c, on AVX-512 VNNI and AMX CPUs; vpmaddwd pairs,
 * src/cpu/qpanels_avx2.c, on AVX2 ones), behind a header that names it: a copy is only
 * read by its own kernel (the row kernels run otherwise, same bits).
 * anneal_gemv_qpanels_useful says whether a panel kernel runs on this CPU (otherwise
 * .qpanels is ignored and a copy is wasted memory; ANNEAL_INT8_PANELS=0 says no). dst
 * holds anneal_gemv_qpanels_len(in, out) bytes (64-byte aligned is best). */
bool anneal_gemv_qpanels_useful(void);
int64_t anneal_gemv_qpanels_len(int64_t in, int64_t out);
void anneal_gemv_pack_qpanels(const int8_t *w, int64_t in, int64_t out, int8_t *dst);

/* Converts n f32 values to bf16 (round to nearest even, as anneal_f32_to_bf16). */
void anneal_gemv_to_bf16(const float *src, uint16_t *dst, int64_t n);

/* int8 of one row of D values: q = round(x / scale) in [-127, 127] (nearest, ties to
 * even), scale = max|x| / 127 (0 for an all-zero row). */
void anneal_kv_quantize_row_i8(const float *x, int64_t D, int8_t *q, float *scale);

/* One layer of a decode step's attention for n rows, row i a new token of cache slot
 * slots[i] at position pos[i] (the slot's length before it). For each row: q and k
 * rotated in place when rope is set (position pos[i], Hugging Face rotate_half as
 * anneal_rope), k and v stored into the cache at pos[i] in its dtype, then each query
 * head h (reading key/value head h / (Hq / Hkv)) attends to positions [0, pos[i]] with
 * scale 1/sqrt(D), the softmax in f32 (max subtracted), into out. */
typedef struct anneal_decode_attn {
    int64_t n;
    const int64_t *slots, *pos;
    float *q, *k, *v;         /* row i at q + i * ld_qkv (Hq*D), k and v likewise (Hkv*D) */
    int64_t ld_qkv;
    int64_t Hq, Hkv, D;
    const anneal_rope_desc *rope; /* NULL: none */
    void *kc, *vc;            /* the layer's cache (slots, Hkv, max_len, D) of dtype */
    float *k_scale, *v_scale; /* int8: (slots, Hkv, max_len) */
    anneal_dtype dtype;       /* ANNEAL_F32, ANNEAL_BF16 or ANNEAL_I8 */
    int64_t max_len;
    float *out;               /* (n, Hq*D) rows ld_out apart */
    int64_t ld_out;
    float *scratch;           /* Hq * max_len floats per row attended one at a time (n rows without kv_scratch) */
    /* Optional (NULL: none): with it, each run of rows of one slot at consecutive
     * positions (a prompt's rows, 2 or more; the runs and single rows may come in any
     * order, a slot in one place) attends through the tensor path's flash kernel over
     * the slot's keys and values widened to f32, instead of row by row. It must hold
     * Hq * r + 2 * Hkv * (last position + 1) * D floats for the largest run of r rows (Hq * r
     * for an f32 cache); a run it cannot hold is attended row by row. */
    float *kv_scratch;
    int64_t kv_scratch_floats;
} anneal_decode_attn;
void anneal_decode_attention(const anneal_decode_attn *a);

/* Row operations (src/cpu/decode_rows.c), the CPU kernels of the tensor path: LayerNorm
 * (b may be NULL) and RMSNorm of n rows of C (y may not alias x), GELU (tanh) in place,
 * g = silu(g) * u over n values. */
void anneal_decode_layer_norm(int64_t n, int64_t C, const float *x, const float *w, const float *b, float eps,
                              float *y);
void anneal_decode_rms_norm(int64_t n, int64_t C, const float *x, const float *w, float eps, float *y);
void anneal_decode_gelu_tanh(int64_t n, float *x);
void anneal_decode_silu_mul(int64_t n, float *g, const float *u);

#ifdef __cplusplus
}
#endif
#endif

/* CPU kernels on raw row-major buffers. Internal to the CPU backend: the backend
 * table (cpu_backend.c) adapts tensors to these calls. Every kernel is
 * multithreaded with OpenMP, never allocates tensors, and is deterministic for a
 * given thread count (reductions combine per-chunk partials in a fixed order, no
 * atomics). Where a kernel says "overwrites", it writes every output element. */
#ifndef ANNEAL_CPU_KERNELS_H
#define ANNEAL_CPU_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------ GEMM */

/* C = alpha * op(A) @ op(B) + beta * C, row-major, op(X) = X or X^T.
 * op(A) is M x K, op(B) is K x N, C is M x N. lda/ldb/ldc are row strides in
 * elements of A, B, C as stored (A stored M x K when !trans_a, K x M when trans_a).
 * beta == 0 means C is not read (may hold NaN). Cache-blocked, packed, vectorised
 * (AVX-512, AVX2 or portable micro-kernels, chosen at run time), OpenMP over output blocks. */
void anneal_cpu_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                      const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                      float *C, int64_t ldc);

/* `batch` independent GEMMs; matrix i uses A + i*stride_a, B + i*stride_b, C + i*stride_c
 * (a stride of 0 broadcasts that operand). */
void anneal_cpu_sgemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N,
                              int64_t K, float alpha, const float *A, int64_t lda,
                              int64_t stride_a, const float *B, int64_t ldb, int64_t stride_b,
                              float beta, float *C, int64_t ldc, int64_t stride_c);

/* What a GEMM does to each finished element of C, after v = alpha*op(A)@op(B) + beta*C
 * (fused into the GEMM while the tile is in cache): add bias[j] (when bias is non-NULL),
 * then, when gelu_tanh, store the value so far in pre (same ldc; if pre is non-NULL) and
 * write gelu_tanh(value) to C;
 * or, when silu_mul is non-NULL (SwiGLU: silu of the gate projection times the up
 * projection), store the value so far in pre (if non-NULL) and write
 * silu(value) * silu_mul[i, j] to C, silu(x) = x / (1 + exp(-x)) in f32 with the
 * operations of anneal_cpu_silu_fwd, so the result is bit for bit anneal_cpu_silu_fwd
 * followed by a multiply. gelu_tanh and silu_mul are exclusive (one activation per
 * product): when both are set, silu_mul is applied and gelu_tanh ignored.
 * And, when b_colsum is non-NULL, b_colsum[j] = the sum over k of op(B)[k, j] (the f32
 * values as given, not rounded to the compute precision; f32 additions in ascending k):
 * computed while op(B) is packed, when it is in cache anyway (a linear layer's bias
 * gradient is the column sums of dy, the B operand of its weight gradient).
 * A zeroed struct (or NULL) does nothing; every field left 0 keeps its old meaning. */
typedef struct anneal_gemm_epilogue {
    const float *bias;     /* (N) or NULL */
    bool gelu_tanh;
    float *pre;            /* (M x N, row stride ldc) or NULL */
    float *b_colsum;       /* (N) or NULL */
    const float *silu_mul; /* (M x N, row stride ldc) or NULL; may not alias C or pre */
} anneal_gemm_epilogue;

/* anneal_cpu_sgemm with the operands rounded to `compute` (ANNEAL_F32: none;
 * ANNEAL_BF16: round to nearest even bf16, products on AVX512-BF16 where the CPU has
 * it; ANNEAL_F16: round to nearest even f16, overflow to inf) while packing, f32
 * accumulation, and an optional epilogue (NULL: none). compute is an anneal_dtype. */
void anneal_cpu_gemm(int compute, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     float alpha, const float *A, int64_t lda, const float *B, int64_t ldb,
                     float beta, float *C, int64_t ldc, const anneal_gemm_epilogue *ep);
/* Packing op(B) once for several products that share it (a weight used by several row
 * chunks): anneal_cpu_gemm_packed_b_size gives the bytes of op(B) (K x N; op(B)[k, n] is
 * B[k*ldb + n], or B[n*ldb + k] when trans_b) packed for products at precision `compute`,
 * anneal_cpu_gemm_pack_b writes it to dst (64-byte aligned; uses threads), and
 * anneal_cpu_gemm_packed computes C = alpha * op(A) @ op(B) + beta * C from it with the
 * same bits as anneal_cpu_gemm on the unpacked B (except M == 1, which anneal_cpu_gemm
 * runs unpacked). Pack and products must use the same compute, K and N, with no GEMM ISA
 * change in between. The epilogue's b_colsum is not available there (B is not at hand). */
size_t anneal_cpu_gemm_packed_b_size(int compute, int64_t K, int64_t N);
void anneal_cpu_gemm_pack_b(int compute, bool trans_b, int64_t K, int64_t N, const float *B,
                            int64_t ldb, void *dst);
void anneal_cpu_gemm_packed(int compute, bool trans_a, int64_t M, int64_t N, int64_t K,
                            float alpha, const float *A, int64_t lda, const void *packed_b,
                            float beta, float *C, int64_t ldc, const anneal_gemm_epilogue *ep);
/* anneal_cpu_sgemm_batched at precision `compute` (no epilogue). */
void anneal_cpu_gemm_batched(int compute, int64_t batch, bool trans_a, bool trans_b, int64_t M,
                             int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                             int64_t stride_a, const float *B, int64_t ldb, int64_t stride_b,
                             float beta, float *C, int64_t ldc, int64_t stride_c);

/* ------------------------------------------------------------- row ops */

/* LayerNorm over the last dim C of N rows: y = (x - mean) * rstd * w + b.
 * mean/rstd (N each) are written for backward. b may be NULL. */
void anneal_cpu_layer_norm_fwd(int64_t N, int64_t C, const float *x, const float *w,
                               const float *b, float eps, float *y, float *mean, float *rstd);
/* Overwrites dx (N x C) if non-NULL, dw (C) and db (C) if non-NULL. */
void anneal_cpu_layer_norm_bwd(int64_t N, int64_t C, const float *x, const float *w,
                               const float *mean, const float *rstd, const float *dy, float *dx,
                               float *dw, float *db);

/* RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). */
void anneal_cpu_rms_norm_fwd(int64_t N, int64_t C, const float *x, const float *w, float eps,
                             float *y, float *rstd);
/* Overwrites dx (if non-NULL) and dw (if non-NULL). */
void anneal_cpu_rms_norm_bwd(int64_t N, int64_t C, const float *x, const float *w,
                             const float *rstd, const float *dy, float *dx, float *dw);

/* Softmax (or log-softmax when log) over the last dim C of N rows. Stable (max-shifted). */
void anneal_cpu_softmax_fwd(int64_t N, int64_t C, const float *x, float *y, bool log);
/* From the forward output y: softmax dx = y*(dy - sum(dy*y)); log: dx = dy - exp(y)*sum(dy). */
void anneal_cpu_softmax_bwd(int64_t N, int64_t C, const float *y, const float *dy, float *dx,
                            bool log);

/* ------------------------------------------------------------ pointwise */

/* GELU over n elements: exact (erf) or tanh approximation (as PyTorch approximate="tanh"). */
void anneal_cpu_gelu_fwd(int64_t n, const float *x, float *y, bool tanh_approx);
void anneal_cpu_gelu_bwd(int64_t n, const float *x, const float *dy, float *dx, bool tanh_approx);
/* SiLU y = x * sigmoid(x). */
void anneal_cpu_silu_fwd(int64_t n, const float *x, float *y);
void anneal_cpu_silu_bwd(int64_t n, const float *x, const float *dy, float *dx);

/* ------------------------------------------------------ embedding & loss */

/* y[i, :] = w[ids[i], :] for N ids, rows of C. ids are validated by the caller (0 <= id < V). */
void anneal_cpu_embedding_fwd(int64_t N, int64_t C, const int32_t *ids, const float *w, float *y);
/* Overwrites dw (V x C) with the scatter-add of dy rows by id; deterministic order
 * (threads split the columns, each walks the ids in order). */
void anneal_cpu_embedding_bwd(int64_t N, int64_t C, int64_t V, const int32_t *ids,
                              const float *dy, float *dw);

/* Cross-entropy of N rows of V logits against targets. For each row writes
 * loss[i] = logsumexp(row) - row[target] and lse[i]; rows whose target equals
 * ignore_index get loss 0. Targets are validated by the caller. */
void anneal_cpu_cross_entropy_fwd(int64_t N, int64_t V, const float *logits,
                                  const int32_t *targets, int32_t ignore_index, float *loss,
                                  float *lse);
/* dlogits[i, :] = scale * (softmax(row) - onehot(target)) for kept rows, 0 for ignored rows
 * (scale is dloss / number of kept rows for a mean). Overwrites dlogits. */
void anneal_cpu_cross_entropy_bwd(int64_t N, int64_t V, const float *logits,
                                  const int32_t *targets, int32_t ignore_index, const float *lse,
                                  float scale, float *dlogits);

/* ------------------------------------------------------------ attention */

/* Multi-head scaled-dot-product attention on strided views whose last dim is
 * contiguous: q and o (B, H, Tq, D), k and v (B, Hkv, Tk, D). Tq queries attend to Tk
 * keys; when causal, query i may see key j <= i + (Tk - Tq) (bottom-right aligned, as a
 * KV cache needs). Grouped-query attention: H is a multiple of Hkv and query head h reads
 * key/value head h / (H / Hkv) (Hkv == 1 is multi-query attention); Hkv == 0 means
 * Hkv = H (plain multi-head attention, the same bits as before the field existed). A Hkv
 * that does not divide H is a caller error; the kernels then use H (they never read
 * outside k, v). */
typedef struct anneal_cpu_attn_desc {
    int64_t B, H, Tq, Tk, D;
    int64_t q_sb, q_sh, q_st; /* element strides of q (and dq) for batch, head, time */
    int64_t k_sb, k_sh, k_st; /* k and dk */
    int64_t v_sb, v_sh, v_st; /* v and dv */
    int64_t o_sb, o_sh, o_st; /* o and dout */
    float scale;              /* usually 1/sqrt(D) */
    bool causal;
    int64_t Hkv;              /* key/value heads; 0 means H */
} anneal_cpu_attn_desc;

/* Flash-style forward: tiles of queries against tiles of keys with an online
 * softmax; never materialises a Tq x Tk matrix. Writes o and lse (B*H*Tq, contiguous,
 * natural-log logsumexp of the scaled scores of each query row). compute (an
 * anneal_dtype): ANNEAL_BF16 rounds the operands of every tile product to bf16 with f32
 * accumulation (softmax statistics, lse and o = acc / l stay f32; attention_bf16.c);
 * anything else is the f32 kernel (f16 included: same bits as ANNEAL_F32). */
void anneal_cpu_attention_fwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                              const float *v, float *o, float *lse, int compute);
/* Tiled backward from (q, k, v, o, dout, lse): recomputes probabilities tile by tile.
 * Overwrites dq (strided like q, one per query head) and dk, dv (strided like k, v, one
 * per key/value head: with grouped-query attention the sum over the query heads of the
 * group). Deterministic, without atomics: each (b, key/value head) is one task that walks
 * the query heads of its group in ascending order, accumulating into its dk, dv, so the
 * bits do not depend on the thread count. compute: the forward's (bf16: every tile
 * product on bf16 operands, f32 accumulation). */
void anneal_cpu_attention_bwd(const anneal_cpu_attn_desc *d, const float *q, const float *k,
                              const float *v, const float *o, const float *dout,
                              const float *lse, float *dq, float *dk, float *dv, int compute);

/* ----------------------------------------------------- rotary embedding */

/* Scaling of the rotary frequencies (transformers' rope_type). */
enum {
    ANNEAL_CPU_ROPE_NONE = 0,   /* "default" */
    ANNEAL_CPU_ROPE_LINEAR = 1, /* "linear": inv_freq / factor (positions / factor) */
    ANNEAL_CPU_ROPE_LLAMA3 = 2, /* "llama3": wavelength-dependent, see rope.c */
};

/* Rotary position embedding of a strided (B, H, T, D) view with unit last stride: row t
 * is at position pos0 + t. Hugging Face Llama semantics (rotate_half: dim i < D/2 pairs
 * with i + D/2); inv_freq[i] = 1 / theta^(2i/D) in f32, scaled as `scaling` says
 * (factor; for llama3 also low_freq_factor, high_freq_factor, original_max_pos, as
 * transformers' _compute_llama3_parameters); see rope.c for the float arithmetic and
 * what matches PyTorch bit for bit. D must be even and > 0 (otherwise nothing is done). */
typedef struct anneal_cpu_rope_desc {
    int64_t B, H, T, D;
    int64_t sb, sh, st; /* element strides of x for batch, head, time */
    float theta;        /* base, e.g. 10000 or 500000; > 0 */
    int scaling;        /* ANNEAL_CPU_ROPE_* */
    float factor;                            /* LINEAR, LLAMA3 */
    float low_freq_factor, high_freq_factor; /* LLAMA3 */
    int64_t original_max_pos;                /* LLAMA3 */
} anneal_cpu_rope_desc;

/* In place: x = rope(x), or with inverse the rotation by the negative angles (the
 * backward of the forward, and exactly its transpose). OpenMP over (position, pair
 * chunk) items; the bits do not depend on the thread count. */
void anneal_cpu_rope(const anneal_cpu_rope_desc *d, float *x, int64_t pos0, bool inverse);
/* The D/2 rotary frequencies of d (after scaling) into inv_freq. */
void anneal_cpu_rope_inv_freq(const anneal_cpu_rope_desc *d, float *inv_freq);

/* ------------------------------------------------------------ optimizer */

/* One AdamW step over n elements (PyTorch semantics): p -= lr*wd*p; m = b1*m + (1-b1)*g;
 * v = b2*v + (1-b2)*g^2; p -= lr * (m/bc1) / (sqrt(v/bc2) + eps), bc = 1 - beta^t. */
void anneal_cpu_adamw(int64_t n, float *p, const float *g, float *m, float *v, double lr,
                      double beta1, double beta2, double eps, double weight_decay, double bc1,
                      double bc2);
/* The same step over n parameters (struct in anneal/backend.h) in one parallel region
 * that splits the total elements evenly; bit-identical to anneal_cpu_adamw on each. */
struct anneal_adamw_group;
void anneal_cpu_adamw_multi(const struct anneal_adamw_group *groups, int n, double lr, double beta1,
                            double beta2, double eps);
/* Sum of squares of n floats, accumulated in double in a fixed chunk order. */
double anneal_cpu_sum_squares(int64_t n, const float *x);

/* ------------------------------------------------------------- int8 */

/* C = A B^T exactly in int32: A int8 (M x K, row stride lda), B int8 (N x K, row stride
 * ldb: a weight in (out, in) layout), C int32 (M x N, row stride ldc); overwrites C.
 * Exact when the true sums fit in int32, which K <= 65536 guarantees (callers check).
 * AMX-INT8, AVX-512 VNNI, AVX2 or portable C (gemm_int8.c); OpenMP over blocks of N. */
void anneal_cpu_gemm_s8(int64_t M, int64_t N, int64_t K, const int8_t *A, int64_t lda, const int8_t *B, int64_t ldb,
                        int32_t *C, int64_t ldc);
/* The int8 GEMM's paths: the one the next call takes (ANNEAL_CPU_ISA=portable|avx2|
 * avx512 in the environment, or a forced one), forcing one (-1 when the CPU lacks it;
 * AUTO restores the choice), and names ("amx", "avx512vnni", "avx2", "portable",
 * "amx-model"). AMX takes products of 32 rows of A and more (fewer: AVX-512 VNNI);
 * AMX_MODEL, for tests, runs the AMX kernel over its C model of the tiles on any CPU
 * (fewer rows: the best other path). */
enum { ANNEAL_GEMM_S8_AUTO = -1, ANNEAL_GEMM_S8_PORTABLE = 0, ANNEAL_GEMM_S8_AVX2 = 1, ANNEAL_GEMM_S8_AVX512VNNI = 2,
       ANNEAL_GEMM_S8_AMX = 3, ANNEAL_GEMM_S8_AMX_MODEL = 4 };
int anneal_cpu_gemm_s8_isa(void);
int anneal_cpu_gemm_s8_set_isa(int isa);
const char *anneal_cpu_gemm_s8_isa_name(int isa);

/* Symmetric int8 quantization of x (rows x cols) per row, or per group of `group`
 * columns of a row (group > 0 divides cols): scale = max(amax / 127, FLT_EPSILON),
 * q = clamp(nearbyint(x / scale), -127, 127). scales: rows x (cols / group), or rows. */
void anneal_cpu_quantize_s8(int64_t rows, int64_t cols, int64_t group, const float *x, int8_t *q, float *scales);
/* The same with one scale for all n values. */
void anneal_cpu_quantize_s8_fixed(int64_t n, const float *x, float scale, int8_t *q);
/* x = q * scale of its row (group), the inverse layout of anneal_cpu_quantize_s8. */
void anneal_cpu_dequantize_s8(int64_t rows, int64_t cols, int64_t group, const int8_t *q, const float *scales,
                              float *x);

enum { ANNEAL_CPU_QUANT_WEIGHT_ONLY = 0, ANNEAL_CPU_QUANT_DYNAMIC = 1, ANNEAL_CPU_QUANT_STATIC = 2 };
/* One quantized dense product y = x W^T + b (quant_int8.c). */
typedef struct anneal_cpu_qmatmul_args {
    int mode;             /* ANNEAL_CPU_QUANT_* */
    int compute;          /* weight-only: ANNEAL_F32 or ANNEAL_BF16 (x rounded to bf16) */
    int64_t M, N, K;
    int64_t group;        /* weight scales per group of K (weight-only), 0: per row of W */
    const float *x;       /* M x K */
    const int8_t *w;      /* N x K */
    const float *wscale;  /* N x (K / group), or N */
    const float *bias;    /* N or NULL */
    float act_scale;      /* static: the activations' scale */
    float *y;             /* M x N, overwritten */
    const int8_t *wpanels; /* dynamic/static: w packed by anneal_gemv_pack_qpanels, or NULL; from 2 rows
                            * on AVX2 the panel kernel reads it (the same bits as from w) */
} anneal_cpu_qmatmul_args;
/* Runs it; 0, or -1 when a workspace could not be allocated. */
int anneal_cpu_qmatmul(const anneal_cpu_qmatmul_args *a);

/* ------------------------------------------------------------- dispatch */

/* True when the running CPU has AVX-512F (checked once). */
bool anneal_cpu_has_avx512(void);
/* True with AVX2, FMA and F16C (checked once). */
bool anneal_cpu_has_avx2(void);

/* The highest instruction-set level the kernels may use, from ANNEAL_ISA (or its older
 * name ANNEAL_CPU_ISA) = portable|avx2|avx512|avx512bf16|amx, read at every call so tests
 * can switch: a kernel family takes its best path at or below the limit that the CPU
 * has. avx512 means AVX-512 F/BW/VL/DQ (and VNNI for int8), avx512bf16 adds VDPBF16PS;
 * unset (or unparsable: anneal_cpu_isa_env_error says so) is ANNEAL_ISA_BEST. */
enum { ANNEAL_ISA_PORTABLE = 0, ANNEAL_ISA_AVX2, ANNEAL_ISA_AVX512, ANNEAL_ISA_AVX512BF16, ANNEAL_ISA_AMX,
       ANNEAL_ISA_BEST };
int anneal_cpu_isa_limit(void);
/* The level's name ("portable", ..., "amx", "best"). */
const char *anneal_cpu_isa_level_name(int level);
/* NULL when ANNEAL_ISA / ANNEAL_CPU_ISA are unset or valid; else a message naming the
 * variable, its value and the accepted ones (the CLI refuses to start with it). */
const char *anneal_cpu_isa_env_error(void);
/* AMX tiles with BF16 and INT8 (CPUID leaf 7 EDX bits 24, 22, 25, and the OS enabling
 * the tile state in XCR0 bits 17-18). The bf16 GEMM runs on them (gemm_amx.c) once
 * anneal_cpu_amx_usable() (backend.h) has also had Linux grant the tile state. */
bool anneal_cpu_has_amx(void);

/* Which ISA path each dispatching kernel family has run since the last reset, for tests
 * and reports (cpu_features.c): one bit per ISA, set with a relaxed atomic OR by the
 * dispatch (a load first, so a path already recorded costs one read per call). */
enum {
    ANNEAL_CPU_OP_GEMM_F32, ANNEAL_CPU_OP_GEMM_BF16, ANNEAL_CPU_OP_GEMM_F16,
    ANNEAL_CPU_OP_ATTN_F32, ANNEAL_CPU_OP_ATTN_BF16, ANNEAL_CPU_OP_COUNT
};
enum {
    ANNEAL_CPU_PATH_PORTABLE = 1, ANNEAL_CPU_PATH_AVX2 = 2, ANNEAL_CPU_PATH_AVX512 = 4,
    ANNEAL_CPU_PATH_AVX512BF16 = 8, ANNEAL_CPU_PATH_AMX = 16
};
void anneal_cpu_path_note(int op, unsigned path);
/* The paths op ran (ANNEAL_CPU_PATH_* bits). */
unsigned anneal_cpu_paths_taken(int op);
void anneal_cpu_paths_reset(void);
/* Names: "gemm f32", ...; "portable", "avx2", "avx512", "avx512bf16", "amx" (one bit). */
const char *anneal_cpu_op_name(int op);
const char *anneal_cpu_path_name(unsigned path);

#endif

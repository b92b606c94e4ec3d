/* The CUDA backend's gemm slots (stub: to be written). */
#include "cuda_internal.h"

extern "C" void anneal_cuda_table_gemm(anneal_backend *b) { (void)b; }
extern "C" bool anneal_cuda_supports_gemm(const anneal_op_query *q) { (void)q; return false; }
extern "C" anneal_status anneal_cuda_gemm_f32(anneal_cuda_ctx *c, const anneal_matmul_desc *d, float *C,
                                              const float *A, const float *B) {
    (void)c; (void)d; (void)C; (void)A; (void)B;
    return anneal_set_error(ANNEAL_ERR_UNSUPPORTED, "cuda gemm: not written yet");
}

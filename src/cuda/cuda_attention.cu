/* The CUDA backend's attention slots (stub: to be written). */
#include "cuda_internal.h"

extern "C" void anneal_cuda_table_attention(anneal_backend *b) { (void)b; }
extern "C" bool anneal_cuda_supports_attention(const anneal_op_query *q) { (void)q; return false; }

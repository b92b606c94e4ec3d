/* The CUDA backend's adamw slots (stub: to be written). */
#include "cuda_internal.h"

extern "C" void anneal_cuda_table_adamw(anneal_backend *b) { (void)b; }
extern "C" bool anneal_cuda_supports_adamw(const anneal_op_query *q) { (void)q; return false; }

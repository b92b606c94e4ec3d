/* The CUDA backend's rows slots (stub: to be written). */
#include "cuda_internal.h"

extern "C" void anneal_cuda_table_rows(anneal_backend *b) { (void)b; }
extern "C" bool anneal_cuda_supports_rows(const anneal_op_query *q) { (void)q; return false; }

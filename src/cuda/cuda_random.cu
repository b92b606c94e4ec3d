/* The CUDA backend's random slots (stub: to be written). */
#include "cuda_internal.h"

extern "C" void anneal_cuda_table_random(anneal_backend *b) { (void)b; }
extern "C" bool anneal_cuda_supports_random(const anneal_op_query *q) { (void)q; return false; }

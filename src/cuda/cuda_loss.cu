/* The CUDA backend's loss slots (stub: to be written). */
#include "cuda_internal.h"

extern "C" void anneal_cuda_table_loss(anneal_backend *b) { (void)b; }
extern "C" bool anneal_cuda_supports_loss(const anneal_op_query *q) { (void)q; return false; }
extern "C" anneal_status anneal_cuda_index_checks_collect(anneal_cuda_ctx *c) { (void)c; return ANNEAL_OK; }

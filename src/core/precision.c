/* The thread's matmul precision (anneal_set_matmul_dtype): a thread-local setting
 * read by the ops that run GEMMs, like grad mode. */
#include "anneal/core.h"

static _Thread_local anneal_dtype matmul_dtype = ANNEAL_F32;

anneal_status anneal_set_matmul_dtype(anneal_dtype dt) {
    if (dt != ANNEAL_F32 && dt != ANNEAL_BF16 && dt != ANNEAL_F16)
        return anneal_set_error(ANNEAL_ERR_ARG, "matmul dtype must be f32, bf16 or f16, not %s",
                                anneal_dtype_name(dt));
    matmul_dtype = dt;
    return ANNEAL_OK;
}

anneal_dtype anneal_get_matmul_dtype(void) { return matmul_dtype; }

/* A dense layer's activation as an op of its own, for the forwards whose product cannot
 * fuse it into a GEMM epilogue (a LoRA adapter's sum, the int8 product, bf16 panels). */
#include "nn_internal.h"

anneal_tensor *anneal_nn_act_unfused(anneal_tensor *pre, anneal_activation act, anneal_tensor *mul) {
    switch (act) {
    case ANNEAL_ACT_NONE: return pre;
    case ANNEAL_ACT_GELU_TANH: return anneal_gelu(pre, true);
    case ANNEAL_ACT_SILU_MUL: return anneal_mul(anneal_silu(pre), mul);
    }
    anneal_set_error(ANNEAL_ERR_ARG, "nn dense: unknown activation %d", (int)act);
    return NULL;
}

/* MLP blocks: GPT-2's fc -> tanh GELU -> proj (the GELU fused into fc's GEMM) and
 * Llama's SwiGLU down(silu(gate x) * up x) (the SiLU and the product fused into the
 * gate GEMM's epilogue). */
#include "nn_internal.h"

anneal_status anneal_nn_mlp_create_gelu(anneal_nn_mlp *m, anneal_params *ps, const char *prefix, int64_t n_embd,
                                        int64_t n_ff, anneal_weight_layout layout, bool bias, const char *fc_name,
                                        const char *proj_name) {
    if (!m || !fc_name || !proj_name) return anneal_set_error(ANNEAL_ERR_ARG, "nn mlp %s: NULL block or name", prefix);
    *m = (anneal_nn_mlp){.kind = ANNEAL_MLP_GELU};
    char name[ANNEAL_NN_NAME_MAX];
    anneal_status s;
    if (!anneal_nn_name(name, sizeof name, "mlp", prefix, fc_name)) return anneal_last_status();
    if ((s = anneal_nn_dense_create(&m->fc, ps, name, n_embd, n_ff, layout, bias)) != ANNEAL_OK) return s;
    if (!anneal_nn_name(name, sizeof name, "mlp", prefix, proj_name)) return anneal_last_status();
    return anneal_nn_dense_create(&m->proj, ps, name, n_ff, n_embd, layout, bias);
}

anneal_status anneal_nn_mlp_create_swiglu(anneal_nn_mlp *m, anneal_params *ps, const char *prefix, int64_t n_embd,
                                          int64_t n_ff, anneal_weight_layout layout, bool bias) {
    if (!m) return anneal_set_error(ANNEAL_ERR_ARG, "nn mlp %s: NULL block", prefix);
    *m = (anneal_nn_mlp){.kind = ANNEAL_MLP_SWIGLU};
    char name[ANNEAL_NN_NAME_MAX];
    anneal_status s;
    if (!anneal_nn_name(name, sizeof name, "mlp", prefix, "gate_proj")) return anneal_last_status();
    if ((s = anneal_nn_dense_create(&m->gate, ps, name, n_embd, n_ff, layout, bias)) != ANNEAL_OK) return s;
    if (!anneal_nn_name(name, sizeof name, "mlp", prefix, "up_proj")) return anneal_last_status();
    if ((s = anneal_nn_dense_create(&m->up, ps, name, n_embd, n_ff, layout, bias)) != ANNEAL_OK) return s;
    if (!anneal_nn_name(name, sizeof name, "mlp", prefix, "down_proj")) return anneal_last_status();
    return anneal_nn_dense_create(&m->down, ps, name, n_ff, n_embd, layout, bias);
}

anneal_tensor *anneal_nn_mlp_forward(const anneal_nn_mlp *m, const anneal_nn_ctx *ctx, anneal_tensor *x) {
    if (!m || !x) return NULL;
    if (m->kind == ANNEAL_MLP_SWIGLU) {
        /* (..., n_ff): up x, then silu(gate x) * (up x) in the gate GEMM's epilogue */
        /* x feeds two projections: saved once in f32 rather than as two bf16 copies */
        anneal_tensor *up = anneal_nn_dense_forward_kept(&m->up, ctx, x, ANNEAL_ACT_NONE, NULL, true);
        anneal_tensor *g = anneal_nn_dense_forward_kept(&m->gate, ctx, x, ANNEAL_ACT_SILU_MUL, up, true);
        return anneal_nn_dense_forward(&m->down, ctx, g);
    }
    /* (..., n_ff) = gelu_tanh(x W_fc + b) in one GEMM, then the projection back */
    anneal_tensor *f = anneal_nn_dense_forward_act(&m->fc, ctx, x, ANNEAL_ACT_GELU_TANH, NULL);
    return anneal_nn_dense_forward(&m->proj, ctx, f);
}

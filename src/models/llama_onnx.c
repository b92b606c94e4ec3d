/* The Llama family's (Llama, Mistral, Qwen2) forward graph for ONNX export, built from
 * the nn blocks' graph pieces in the order of llama.c's forward: token embedding, N
 * pre-norm layers (RMSNorm, q/k/v projections with their biases, RoPE with the config's
 * theta and scaling, grouped-query causal attention, o_proj, residual; RMSNorm, SwiGLU,
 * residual), final RMSNorm, the lm head (the embedding when tied, lm_head otherwise). */
#include "llama_internal.h"

anneal_status anneal_llama_onnx_graph(const anneal_model *mm, anneal_onnx_graph *g, bool kv_cache) {
    const anneal_llama *m = (const anneal_llama *)mm;
    const anneal_model_config *c = &mm->cfg;
    int hkv = c->n_kv_head ? c->n_kv_head : c->n_head;
    int64_t D = c->n_embd / c->n_head;
    /* anneal's own cos and sin of every position < n_ctx, gathered at the positions */
    const char *cos = NULL, *sin = NULL;
    anneal_status s = anneal_onnx_rope_tables(g, &m->rope, c->n_ctx, D, &cos, &sin);
    anneal_onnx_decoder d;
    if (s == ANNEAL_OK) s = anneal_onnx_decoder_begin(g, &d, c->n_layer, hkv, D, kv_cache, cos, sin);
    if (s != ANNEAL_OK) return s;
    anneal_onnx_set_prefix(g, "model");
    const char *x = anneal_nn_embedding_onnx(g, &m->embed, d.ids);
    for (int l = 0; l < c->n_layer; l++) {
        const anneal_llama_block *b = &m->blocks[l];
        anneal_onnx_set_prefix(g, "model.layers.%d", l);
        const char *h = anneal_nn_rms_norm_onnx(g, &b->input_layernorm, x);
        x = anneal_onnx_op2(g, "Add", x, anneal_nn_attention_onnx(g, &b->attn, &d, l, h));
        h = anneal_nn_rms_norm_onnx(g, &b->post_attention_layernorm, x);
        x = anneal_onnx_op2(g, "Add", x, anneal_nn_mlp_onnx(g, &b->mlp, h));
    }
    anneal_onnx_set_prefix(g, "lm_head");
    const char *h = anneal_nn_rms_norm_onnx(g, &m->norm, x);
    const anneal_tensor *wt = m->lm_head.weight ? m->lm_head.weight : m->embed.weight;
    const char *w = anneal_onnx_weight(g, wt->name, (anneal_tensor *)wt, false);
    if (m->lm_head.weight && m->lm_head.lora)
        anneal_onnx_graph_fail(g, ANNEAL_ERR_UNSUPPORTED, "lm_head carries a LoRA adapter: merge it first");
    return anneal_onnx_decoder_end(g, &d, anneal_onnx_lm_head(g, h, w, c->n_embd), c->vocab_size);
}

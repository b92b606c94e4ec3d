/* GPT-2's forward graph for ONNX export, built from the nn blocks' graph pieces in the
 * order of gpt2.c's forward: token + position embeddings, N pre-LN blocks (LayerNorm,
 * attention, residual; LayerNorm, GELU MLP, residual), final LayerNorm, the lm head
 * tied to the token embedding (one initializer, read by Gather and by the head's Gemm). */
#include "gpt2_hf.h"

anneal_status anneal_gpt2_onnx_graph(const anneal_model *mm, anneal_onnx_graph *g, bool kv_cache) {
    const anneal_gpt2 *m = (const anneal_gpt2 *)mm;
    const anneal_model_config *c = &mm->cfg;
    anneal_onnx_decoder d;
    anneal_status s = anneal_onnx_decoder_begin(g, &d, c->n_layer, c->n_head, c->n_embd / c->n_head, kv_cache, NULL,
                                                NULL);
    if (s != ANNEAL_OK) return s;
    anneal_onnx_set_prefix(g, "transformer");
    /* (B, T, C) + (T, C): wpe at the positions after the past ones */
    const char *x = anneal_onnx_op2(g, "Add", anneal_nn_embedding_onnx(g, &m->wte, d.ids),
                                    anneal_nn_embedding_onnx(g, &m->wpe, d.positions));
    for (int l = 0; l < c->n_layer; l++) {
        const anneal_gpt2_block *b = &m->blocks[l];
        anneal_onnx_set_prefix(g, "transformer.h.%d", l);
        const char *h = anneal_nn_layer_norm_onnx(g, &b->ln_1, x);
        x = anneal_onnx_op2(g, "Add", x, anneal_nn_attention_onnx(g, &b->attn, &d, l, h));
        x = anneal_onnx_op2(g, "Add", x, anneal_nn_mlp_onnx(g, &b->mlp, anneal_nn_layer_norm_onnx(g, &b->ln_2, x)));
    }
    anneal_onnx_set_prefix(g, "lm_head");
    const char *h = anneal_nn_layer_norm_onnx(g, &m->ln_f, x);
    const char *w = anneal_onnx_weight(g, m->wte.weight->name, m->wte.weight, false); /* the Gather's table */
    return anneal_onnx_decoder_end(g, &d, anneal_onnx_lm_head(g, h, w, c->n_embd), c->vocab_size);
}

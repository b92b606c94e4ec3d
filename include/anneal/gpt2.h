/* GPT-2 (Hugging Face layout and parameter names), one architecture of the model
 * interface (model.h): registered as "gpt2", reading config.json files of model_type
 * "gpt2". The trainer, eval, generate and checkpoints use it through anneal_model;
 * this header is for code that works on GPT-2 itself (tests, benchmarks): its blocks
 * and parameters by field. */
#ifndef ANNEAL_GPT2_H
#define ANNEAL_GPT2_H

#include "anneal/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The architecture (registered by the library; model.h's registry finds it). */
extern const anneal_model_arch anneal_gpt2_arch;

struct anneal_gpt2;

/* One pre-LN block: LN -> attention (packed c_attn, causal) -> c_proj -> dropout ->
 * residual; LN -> MLP (c_fc + GELU, c_proj) -> dropout -> residual. */
typedef struct anneal_gpt2_block {
    const struct anneal_gpt2 *model; /* back-pointer: a block is its own recompute context */
    int layer;
    anneal_nn_layer_norm ln_1;       /* transformer.h.<l>.ln_1 */
    anneal_nn_attention attn;        /* .attn.c_attn (C, 3C), .attn.c_proj (C, C) */
    anneal_nn_layer_norm ln_2;       /* .ln_2 */
    anneal_nn_mlp mlp;               /* .mlp.c_fc (C, 4C), .mlp.c_proj (4C, C) */
} anneal_gpt2_block;

typedef struct anneal_gpt2 {
    anneal_model base;          /* first: an anneal_gpt2 * is an anneal_model * */
    anneal_nn_embedding wte;    /* transformer.wte (vocab, C), also the tied lm head */
    anneal_nn_embedding wpe;    /* transformer.wpe (n_ctx, C) */
    anneal_gpt2_block *blocks;  /* n_layer */
    anneal_nn_layer_norm ln_f;  /* transformer.ln_f */
} anneal_gpt2;

/* Fills *out with a named preset: "tiny" (2 layers, 4 heads, 64 channels, vocab 512,
 * ctx 256), "d6" (6, 6, 384, vocab 50257, ctx 1024), "124M"/"gpt2", "350M"/"gpt2-medium",
 * "774M"/"gpt2-large", "1.5B"/"gpt2-xl" (GPT-2's published sizes, vocab 50257, ctx 1024).
 * Returns false for an unknown name. */
bool anneal_gpt2_preset(const char *name, anneal_model_config *out);
/* Checks a config: arch "gpt2" (or empty), positive sizes, n_embd divisible by n_head,
 * dropout in [0, 1), norm_eps > 0; n_kv_head 0 or n_head, n_ff 0 or 4 n_embd, no RoPE. */
anneal_status anneal_gpt2_config_check(const anneal_model_config *cfg);

/* A GPT-2 with zero parameters on the CPU (an empty cfg->arch means "gpt2"); NULL + error
 * on a bad config or OOM. Free it with anneal_gpt2_free or anneal_model_free. */
anneal_gpt2 *anneal_gpt2_new(const anneal_model_config *cfg);
void anneal_gpt2_free(anneal_gpt2 *m);
/* GPT-2 initialisation from the global generator after anneal_manual_seed(seed):
 * weights normal(0, 0.02), residual projections (attn.c_proj, mlp.c_proj) normal(0,
 * 0.02/sqrt(2*n_layer)), biases 0, LayerNorm weights 1. */
anneal_status anneal_gpt2_init(anneal_gpt2 *m, uint64_t seed);
/* Final hidden states (B, T, C) for i32 ids (B, T), after ln_f. */
anneal_tensor *anneal_gpt2_hidden(anneal_gpt2 *m, anneal_tensor *ids);
/* Logits (B, T, vocab) from the tied lm head. */
anneal_tensor *anneal_gpt2_forward(anneal_gpt2 *m, anneal_tensor *ids);
/* Mean cross-entropy of the next-token prediction: 0-dim tensor (targets -100 ignored). */
anneal_tensor *anneal_gpt2_loss(anneal_gpt2 *m, anneal_tensor *ids, anneal_tensor *targets);
/* One block on x (B, T, C): kv NULL for training (recompute as cfg.recompute says);
 * otherwise the attention runs over layer `layer` of the cache. */
anneal_tensor *anneal_gpt2_block_forward(const anneal_gpt2_block *b, anneal_tensor *x, anneal_kv_cache *kv);
/* Training FLOPs per token: 6N + 12*L*T*C (forward + backward, PaLM appendix B). */
double anneal_gpt2_flops_per_token(const anneal_gpt2 *m, int64_t T);

#ifdef __cplusplus
}
#endif
#endif

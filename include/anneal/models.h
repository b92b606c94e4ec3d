/* anneal models: GPT-2 (Hugging Face layout and parameter names). */
#ifndef ANNEAL_MODELS_H
#define ANNEAL_MODELS_H

#include "anneal/nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Activation recomputation (checkpointing): what backward recomputes instead of
 * keeping from the forward pass. BLOCK is 1 so that `recompute = true` means it. */
typedef enum anneal_recompute_mode {
    ANNEAL_RECOMPUTE_NONE = 0,  /* keep every saved activation */
    ANNEAL_RECOMPUTE_BLOCK = 1, /* keep only each block's input; replay the whole block */
    ANNEAL_RECOMPUTE_ATTN = 2,  /* replay qkv GEMM + attention (drops qkv (B,T,3C) and the
                                   attention statistics); the rest of the block is kept */
} anneal_recompute_mode;

/* "none", "attn", "block" (and "on" = block, "off" = none); false for anything else. */
bool anneal_recompute_parse(const char *s, anneal_recompute_mode *out);
/* The canonical name of a mode ("none", "attn", "block"; "?" if invalid). */
const char *anneal_recompute_name(anneal_recompute_mode m);

typedef struct anneal_gpt2_config {
    int n_layer, n_head, n_embd;
    int vocab_size; /* rows of wte (and of the tied lm head) */
    int n_ctx;      /* rows of wpe: longest sequence */
    float dropout;  /* embedding, attention-output and MLP-output dropout (training only) */
    float ln_eps;   /* LayerNorm epsilon (1e-5) */
    anneal_recompute_mode recompute; /* activation recomputation (default NONE) */
} anneal_gpt2_config;

/* Fills *out with a named preset: "tiny" (2 layers, 4 heads, 64 channels, vocab 512,
 * ctx 256), "d6" (6, 6, 384, vocab 50257, ctx 1024), "124M"/"gpt2", "350M"/"gpt2-medium",
 * "774M"/"gpt2-large", "1.5B"/"gpt2-xl" (GPT-2's published sizes, vocab 50257, ctx 1024).
 * Returns false for an unknown name. */
bool anneal_gpt2_preset(const char *name, anneal_gpt2_config *out);
/* Checks a config (positive sizes, n_embd divisible by n_head, dropout in [0,1), ...). */
anneal_status anneal_gpt2_config_check(const anneal_gpt2_config *cfg);

struct anneal_gpt2;

typedef struct anneal_gpt2_block {
    const struct anneal_gpt2 *model; /* back-pointer: a block is its own recompute context */
    anneal_tensor *ln_1_w, *ln_1_b;
    anneal_tensor *c_attn_w, *c_attn_b; /* (C, 3C), (3C) */
    anneal_tensor *attn_proj_w, *attn_proj_b; /* (C, C), (C) */
    anneal_tensor *ln_2_w, *ln_2_b;
    anneal_tensor *c_fc_w, *c_fc_b;     /* (C, 4C), (4C) */
    anneal_tensor *mlp_proj_w, *mlp_proj_b; /* (4C, C), (C) */
} anneal_gpt2_block;

typedef struct anneal_gpt2 {
    anneal_gpt2_config cfg;
    anneal_params *params; /* HF names: transformer.wte.weight, transformer.h.0.ln_1.weight, ... */
    anneal_tensor *wte, *wpe, *ln_f_w, *ln_f_b;
    anneal_gpt2_block *blocks;
    bool training;         /* dropout on when true */
    anneal_dtype compute;  /* GEMM and attention precision of every op (0 = ANNEAL_F32) */
} anneal_gpt2;

/* Allocates a model with zero parameters (NULL + error on a bad config or OOM). */
anneal_gpt2 *anneal_gpt2_new(const anneal_gpt2_config *cfg);
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
/* Number of parameters (tied embedding counted once). */
int64_t anneal_gpt2_num_params(const anneal_gpt2 *m);
/* Training FLOPs per token: 6N + 12*L*T*C (forward + backward, PaLM appendix B). */
double anneal_gpt2_flops_per_token(const anneal_gpt2 *m, int64_t T);

/* ------------------------------------------------------------ generation */

/* Keys and values of every layer for the positions seen so far, so each new token
 * costs one position of attention instead of the whole prefix. */
typedef struct anneal_gpt2_kv_cache anneal_gpt2_kv_cache;

/* A cache for `batch` sequences of up to max_len (<= n_ctx) positions. */
anneal_gpt2_kv_cache *anneal_gpt2_kv_cache_new(const anneal_gpt2 *m, int64_t batch, int64_t max_len);
void anneal_gpt2_kv_cache_free(anneal_gpt2_kv_cache *kv);
/* Forgets every position. */
void anneal_gpt2_kv_cache_reset(anneal_gpt2_kv_cache *kv);
/* Positions cached so far. */
int64_t anneal_gpt2_kv_cache_len(const anneal_gpt2_kv_cache *kv);
/* Logits (B, T_new, vocab) of ids (B, T_new) placed after the cached positions, which
 * then include them. No autograd. Equals the last T_new rows of anneal_gpt2_forward on
 * the whole sequence. Exceeding max_len is ANNEAL_ERR_SHAPE. */
anneal_tensor *anneal_gpt2_forward_cached(anneal_gpt2 *m, anneal_gpt2_kv_cache *kv, anneal_tensor *ids);

typedef struct anneal_sampler_config {
    float temperature; /* <= 0: greedy (argmax) */
    int top_k;         /* keep the k most likely (0 = all) */
    float top_p;       /* keep the smallest set with probability >= top_p (1 = all) */
    uint64_t seed;     /* with the token position, picks the random number: reproducible */
} anneal_sampler_config;

/* Picks an id from V logits: temperature, then top-k, then top-p (nucleus), then a
 * draw with Philox(seed, position). Deterministic for equal inputs. */
int32_t anneal_sample_logits(const float *logits, int64_t V, const anneal_sampler_config *cfg,
                             uint64_t position);

/* Called with each generated id; return false to stop. */
typedef bool (*anneal_token_fn)(int32_t id, void *user);

/* Generates up to max_new ids after the prompt with a KV cache, calling on_token for
 * each; stops early at stop_id (if >= 0; not passed to on_token) or when on_token
 * returns false. When the sequence reaches n_ctx, the cache is rebuilt from the last
 * n_ctx/2 tokens and generation continues. Runs under no-grad. */
anneal_status anneal_gpt2_generate(anneal_gpt2 *m, const int32_t *prompt, int64_t n_prompt,
                                   int64_t max_new, const anneal_sampler_config *cfg,
                                   int32_t stop_id, anneal_token_fn on_token, void *user);

#ifdef __cplusplus
}
#endif
#endif

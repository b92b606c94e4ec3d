/* The decode engine (decode_engine.c): one decode step for n cache slots as raw loops
 * over the model's weights (GEMV kernels, attention over the cache's stored dtype),
 * with its workspace kept in the cache: no per-token allocation, no tensors, no
 * autograd. An architecture describes its decoder as a plan (the weights of every
 * layer as the kernels read them); gpt2.c and llama.c fill theirs. */
#ifndef ANNEAL_DECODE_ENGINE_H
#define ANNEAL_DECODE_ENGINE_H

#include "anneal/decode_kernels.h"
#include "anneal/model.h"

/* One decoder layer. */
typedef struct anneal_decode_block_plan {
    const float *n1_w, *n1_b;   /* the attention's norm (b NULL: RMSNorm or no bias) */
    const float *n2_w, *n2_b;   /* the MLP's norm */
    anneal_gemv_weight q, k, v; /* packed (GPT-2's c_attn): q holds all (q | k | v) and k.w, v.w are NULL */
    anneal_gemv_weight o;       /* attention output projection */
    anneal_gemv_weight fc;      /* GPT-2: c_fc (then GELU tanh); Llama: gate_proj (then SiLU) */
    anneal_gemv_weight up;      /* Llama: up_proj (w NULL for GPT-2) */
    anneal_gemv_weight down;    /* GPT-2: mlp.c_proj; Llama: down_proj */
} anneal_decode_block_plan;

/* A decoder-only model as the engine runs it. */
typedef struct anneal_decode_plan {
    int n_layer;
    int64_t C, Hq, Hkv, D, F, V;
    float eps;
    bool rms;                     /* RMSNorm (Llama) or LayerNorm with bias (GPT-2) */
    const float *tok_emb;         /* (V, C) f32 */
    const float *pos_emb;         /* (n_ctx, C) f32 learned positions (GPT-2), or NULL */
    const anneal_rope_desc *rope; /* rotary embedding (Llama), or NULL */
    const float *nf_w, *nf_b;     /* final norm */
    anneal_gemv_weight head;      /* lm head (V, C) out_in */
    anneal_decode_block_plan *blocks;
} anneal_decode_plan;

/* The weight of dense layer d as the GEMV reads it; false when the engine cannot run it
 * (a LoRA adapter, a dtype other than f32 / bf16, a non-contiguous weight). */
bool anneal_decode_dense(const anneal_nn_dense *d, anneal_gemv_weight *w);

/* The int8 lm head of ps (ps->head, anneal_model_quantize_head) into w in place of the
 * f32 head the plan named (same in/out); true with w unchanged when the head is not
 * quantized, false when the engine cannot read the int8 one. */
bool anneal_decode_head(const anneal_params *ps, anneal_gemv_weight *w);

/* Fill p (blocks: n_layer entries allocated by the caller) for the engine; false (no
 * error recorded) when the model has something the engine does not run. */
bool anneal_gpt2_decode_plan(anneal_model *m, anneal_decode_plan *p);
bool anneal_llama_decode_plan(anneal_model *m, anneal_decode_plan *p);

/* One decode step (see anneal_model_decode_slots, whose checks have passed): row i of
 * out (n, vocab) gets the logits of ids[i] appended to slot slots[i], and each slot's
 * length grows by one. ANNEAL_ERR_UNSUPPORTED, with nothing changed and no error
 * recorded, when the model or cache is not one the engine runs (another device or
 * architecture, LoRA, int8 weights): the caller then takes the tensor path. */
anneal_status anneal_decode_engine_step(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                        const int32_t *ids, int64_t n, float *out);

/* A prompt's prefill (see anneal_model_prefill_slot, whose checks have passed): the n ids
 * appended to slot `slot` in chunks of up to the engine's rows (128 for GPT-2 124M),
 * each chunk one pass over the weights with causal attention inside it, and the logits
 * (vocab) of the last id into out. ANNEAL_ERR_UNSUPPORTED as for a step (nothing
 * changed); on another error the slot is back at its length before the call. */
anneal_status anneal_decode_engine_prefill(anneal_model *m, anneal_kv_cache *kv, int64_t slot, const int32_t *ids,
                                           int64_t n, float *out);

/* Continuous batching's mixed step (see anneal_model_extend_slots, whose checks have
 * passed): entry i appends counts[i] ids (the entries' ids one after another in ids) to
 * slot slots[i] (n distinct slots), all rows in one pass over the weights (a prompt's
 * rows attend as a run), and row i of out (n, vocab) gets the logits of entry i's last
 * id. ANNEAL_ERR_UNSUPPORTED, nothing changed, as for a step and when the rows do not
 * fit the engine's prefill chunk; on another error nothing advanced. */
anneal_status anneal_decode_engine_extend(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                          const int32_t *ids, const int64_t *counts, int64_t n, float *out);

/* Steps, prefills and extends the engine has run in this process (tests check which
 * path ran). */
int64_t anneal_decode_engine_steps(void);
int64_t anneal_decode_engine_prefills(void);
int64_t anneal_decode_engine_extends(void);
/* int8 panel copies (anneal_gemv_pack_qpanels) the engines have made in this process. */
int64_t anneal_decode_engine_qpanel_copies(void);

#endif

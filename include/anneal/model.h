/* The model interface. A model architecture (GPT-2, later Llama) is one
 * anneal_model_arch, registered once (src/models/registry.c, one line each); a model
 * is an anneal_model whose ops table the architecture fills. The trainer, eval,
 * generate, checkpoints and the command line use only this interface, so a new
 * architecture is a file in src/models/ plus its registration line.
 *
 * Hyperparameters live in one anneal_model_config shared by the decoder-only
 * families (as llama.cpp's hparams): each architecture reads the fields it uses and
 * checks the rest are at their defaults. Parameters carry Hugging Face names, so a
 * checkpoint's model.safetensors + config.json is a Hugging Face model directory. */
#ifndef ANNEAL_MODEL_H
#define ANNEAL_MODEL_H

#include "anneal/backend.h"
#include "anneal/nn.h"
#include "anneal/onnx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Activation recomputation (checkpointing): what backward recomputes instead of
 * keeping from the forward pass. BLOCK is 1 so that `recompute = true` means it. */
typedef enum anneal_recompute_mode {
    ANNEAL_RECOMPUTE_NONE = 0,  /* keep every saved activation */
    ANNEAL_RECOMPUTE_BLOCK = 1, /* keep only each block's input; replay the whole block */
    ANNEAL_RECOMPUTE_ATTN = 2,  /* replay the qkv projection and attention of each block
                                   (drops qkv and the attention statistics) */
} anneal_recompute_mode;

/* "none", "attn", "block" (and "on" = block, "off" = none); false for anything else. */
bool anneal_recompute_parse(const char *s, anneal_recompute_mode *out);
/* The canonical name of a mode ("none", "attn", "block"; "?" if invalid). */
const char *anneal_recompute_name(anneal_recompute_mode m);

#define ANNEAL_ARCH_NAME_MAX 32

/* Hyperparameters of a decoder-only language model. Zero means "the architecture's
 * default" for the optional fields. */
typedef struct anneal_model_config {
    char arch[ANNEAL_ARCH_NAME_MAX]; /* registered architecture: "gpt2" */
    int n_layer, n_head, n_embd;
    int n_kv_head;       /* key/value heads (GQA); 0: n_head */
    int n_ff;            /* MLP hidden width; 0: the architecture's (GPT-2: 4 * n_embd) */
    int vocab_size;      /* rows of the token embedding */
    int n_ctx;           /* longest sequence (GPT-2: rows of wpe) */
    float norm_eps;      /* LayerNorm / RMSNorm epsilon */
    float dropout;       /* dropout probability while training */
    float rope_theta;    /* rotary base (architectures with RoPE) */
    anneal_rope_desc rope; /* rotary scaling (architectures with RoPE) */
    bool tie_embeddings; /* lm head shares the token embedding (GPT-2: always, whatever is set) */
    anneal_recompute_mode recompute;
    /* Llama family (zero elsewhere): */
    bool qkv_bias;       /* biases on the q/k/v projections (Qwen2; Llama's attention_bias) */
    bool out_bias;       /* bias on the attention output projection (Llama's attention_bias) */
    char hf_model_type[ANNEAL_ARCH_NAME_MAX]; /* the Hugging Face model_type read, written back by
                                                 config_to_hf ("qwen2" stays "qwen2"); "": the
                                                 architecture's own */
    /* Tensor parallelism (set by the trainer, never saved): the model holds rank tp_rank's
     * 1/tp_size of the attention heads and MLP width and runs with ctx.tp; 0 or 1: whole. */
    int tp_size, tp_rank;
    bool tp_vocab_whole; /* keep the vocabulary whole on every rank even when tp_size divides it */
} anneal_model_config;

typedef struct anneal_model anneal_model;
typedef struct anneal_model_arch anneal_model_arch;

/* The key/value cache of generation is nn.h's anneal_kv_cache (per layer, the keys and
 * values of every position seen so far, so each new token costs one position of
 * attention); a model makes one with kv_cache_new, anneal_kv_cache_free frees it. */

/* Where Hugging Face import reads tensors from (io implements it over safetensors
 * files). info tells whether tensor `name` is there and its stored dtype and shape
 * without reading it (false, nothing recorded, when absent), so an import checks every
 * tensor before it reads any; get returns the tensor converted to f32 on the CPU in
 * the current scope, or NULL without an error when there is none (errors otherwise:
 * a dtype that is not a float, a read failure); names lists every tensor present (n of
 * them) for unknown-key checks. */
typedef struct anneal_tensor_source {
    void *ctx;
    const char *what; /* names the source in errors (the file's path) */
    bool (*info)(void *ctx, const char *name, anneal_dtype *dtype, int *ndim, int64_t *shape);
    anneal_tensor *(*get)(void *ctx, const char *name);
    int n;
    const char *const *names;
} anneal_tensor_source;

/* Where Hugging Face export writes tensors to (io implements it): put stores a
 * contiguous tensor under name (the data is copied or written before put returns). */
typedef struct anneal_tensor_sink {
    void *ctx;
    anneal_status (*put)(void *ctx, const char *name, const anneal_tensor *t);
} anneal_tensor_sink;

/* What every model does; filled by its architecture. */
typedef struct anneal_model_ops {
    void (*free)(anneal_model *m);
    /* The architecture's initialisation, drawing from the global generator after
     * anneal_manual_seed(seed). */
    anneal_status (*init)(anneal_model *m, uint64_t seed);
    /* Mean next-token cross-entropy of ids (B, T) against targets (B, T) (i32, -100
     * ignored): a 0-dim tensor on the model's device. */
    anneal_tensor *(*loss)(anneal_model *m, anneal_tensor *ids, anneal_tensor *targets);
    /* Logits (B, T, vocab) of ids (B, T). */
    anneal_tensor *(*logits)(anneal_model *m, anneal_tensor *ids);
    /* A cache for `batch` sequences of up to max_len (<= n_ctx) positions. */
    anneal_kv_cache *(*kv_cache_new)(anneal_model *m, int64_t batch, int64_t max_len);
    /* Logits (B, rows, vocab) of the last `rows` (1 <= rows <= T_new) of ids (B, T_new)
     * placed after the cached positions: equal to the matching rows of logits() on the
     * whole sequence. Writes every layer's new keys and values into kv, leaving
     * anneal_kv_cache_len to the caller (anneal_model_forward_cached checks the
     * arguments, runs it without autograd or dropout and advances the cache). */
    anneal_tensor *(*forward_cached)(anneal_model *m, anneal_kv_cache *kv, anneal_tensor *ids, int64_t rows);
    /* Training FLOPs per token at sequence length T (forward + backward). */
    double (*flops_per_token)(const anneal_model *m, int64_t T);
    /* Copies the weights of a Hugging Face checkpoint of this architecture into m:
     * every parameter must be found (shapes equal, f32 conversion of float dtypes),
     * tied or absent tensors handled as transformers does, unknown tensors refused; m
     * is only written once everything checks out. */
    anneal_status (*hf_import)(anneal_model *m, const anneal_tensor_source *src);
    /* Writes the weights under their Hugging Face names (what transformers'
     * save_pretrained writes for this architecture). */
    anneal_status (*hf_export)(const anneal_model *m, const anneal_tensor_sink *sink);
    /* Optional (NULL: the architecture has no ONNX export). Describes the forward pass
     * into g with the nn blocks' graph pieces (include/anneal/onnx.h): input_ids
     * (batch, sequence) int64 -> logits (batch, sequence, vocab), and with kv_cache the
     * past_key_values.N.key/.value inputs and present.N.key/.value outputs, the new
     * rows placed after the past ones. The graph keeps references to m's tensors. */
    anneal_status (*onnx_graph)(const anneal_model *m, anneal_onnx_graph *g, bool kv_cache);
    /* Optional (NULL: no pipeline parallelism). The training forward of a pipeline stage
     * made of blocks [first, last): first == 0 embeds in = ids (B, T), otherwise in is the
     * hidden state (B, T, C) the stage before produced; last == n_layer ends with the
     * final norm, lm head and mean cross-entropy against targets (a 0-dim loss, the ops
     * loss() makes; targets NULL: the logits (B, T, V) instead), otherwise the hidden
     * state after block last - 1 is returned. The stages chained give loss()'s value and
     * gradients. */
    anneal_tensor *(*stage_forward)(anneal_model *m, int first, int last, anneal_tensor *in, anneal_tensor *targets);
    /* With stage_forward: the blocks that use parameter i (registration order), *first to
     * *last, -1 meaning the embedding before block 0 and n_layer the final norm and head
     * (a tied embedding: -1 and n_layer). */
    void (*param_span)(const anneal_model *m, int i, int *first, int *last);
} anneal_model_ops;

/* Called just before (before = true) and just after each transformer block's forward,
 * also when a recompute region replays the block in backward (ZeRO-3 gathers the
 * block's parameters there and releases them after). A failure makes the forward
 * return NULL with that error. */
typedef anneal_status (*anneal_block_hook_fn)(void *user, int layer, bool before);

/* A model: the fields every architecture has. Architectures embed it first in their
 * own struct. */
struct anneal_model {
    const anneal_model_arch *arch;
    const anneal_model_ops *ops;
    anneal_model_config cfg;
    anneal_device device;  /* where the parameters live */
    anneal_params *params; /* Hugging Face names, registration order */
    anneal_nn_ctx ctx;     /* precision and training mode the forward passes run with */
    anneal_block_hook_fn block_hook; /* NULL: none */
    void *block_hook_user;
};

/* The block hook's calls, for architectures: enter before block `layer` runs (an error
 * from the hook is returned), leave after it with its output y (returns y, or NULL when
 * the hook failed). Without a hook enter is ANNEAL_OK and leave returns y. */
anneal_status anneal_model_block_enter(const anneal_model *m, int layer);
anneal_tensor *anneal_model_block_leave(const anneal_model *m, int layer, anneal_tensor *y);

/* How llama.cpp names and lays out an architecture's tensors in a GGUF file (what its
 * convert_hf_to_gguf.py writes), for io's GGUF export and import (anneal/gguf.h). Each
 * architecture keeps its table in its own file (src/models/<arch>_gguf.c). */
typedef enum anneal_gguf_layout {
    ANNEAL_GGUF_SAME = 0,   /* stored as the Hugging Face tensor */
    ANNEAL_GGUF_TRANSPOSED, /* 2-D, transposed (GPT-2's Conv1D (in, out) becomes (out, in)) */
    ANNEAL_GGUF_PERMUTE_Q,  /* rows of each of n_head heads reordered from rotate-half to interleaved RoPE */
    ANNEAL_GGUF_PERMUTE_K,  /* the same over n_kv_head heads */
} anneal_gguf_layout;

/* One tensor: Hugging Face name and GGUF name, "%d" in both for the layer. */
typedef struct anneal_gguf_name {
    const char *hf, *gguf;
    anneal_gguf_layout layout;
} anneal_gguf_name;

typedef struct anneal_gguf_arch {
    const char *name;       /* general.architecture ("gpt2", "llama") */
    bool rms_norm;          /* eps under attention.layer_norm_rms_epsilon (else layer_norm_epsilon) */
    bool rope;              /* head_count_kv, rope.* and vocab_size keys, as the converter writes them */
    bool output_copy;       /* output.weight is written as a copy of the token embedding (GPT-2) */
    const anneal_gguf_name *names; /* ended by {NULL} */
    /* Refuses (ANNEAL_ERR_UNSUPPORTED naming the setting) a config this GGUF
     * architecture cannot express; NULL: every valid config can be written. */
    anneal_status (*check)(const anneal_model_config *c);
} anneal_gguf_arch;

/* An architecture: how to make its models and translate its configs. */
struct anneal_model_arch {
    const char *name;                     /* "gpt2" */
    const char *const *hf_model_types;    /* config.json "model_type" values it reads (NULL-ended) */
    const char *hf_architecture;          /* what config.json's "architectures" gets on export */
    /* Fills *out with a named preset of this architecture; false if it has none by that
     * name (preset may be NULL: no presets). */
    bool (*preset)(const char *name, anneal_model_config *out);
    const char *const *preset_names;      /* the presets, for help and errors (NULL-ended; may be NULL) */
    /* Checks a config (ANNEAL_ERR_ARG naming the field). */
    anneal_status (*config_check)(const anneal_model_config *c);
    /* Reads a Hugging Face config.json text into *out (source names it in errors):
     * ANNEAL_ERR_FORMAT for a malformed field, ANNEAL_ERR_UNSUPPORTED for a setting this
     * architecture does not implement. The registry then checks the result with
     * config_check, so config_from_hf only translates. */
    anneal_status (*config_from_hf)(const char *json, const char *source, anneal_model_config *out);
    /* The Hugging Face config.json text of c (malloc'd); the registry has checked c. */
    char *(*config_to_hf)(const anneal_model_config *c);
    /* A model with zero-filled parameters on device dev (NULL + error); the config has
     * passed config_check. It fills every field of anneal_model (ops, cfg, device,
     * params; ctx zero: f32, not training) but arch, which anneal_model_new sets. */
    anneal_model *(*create)(const anneal_model_config *c, anneal_device dev);
    /* GGUF names and layouts (NULL: no GGUF export/import for this architecture). */
    const anneal_gguf_arch *gguf;
};

/* ------------------------------------------------------------ the registry */

/* Adds an architecture (the library's own are registered on first use). Fails on a
 * duplicate name. */
anneal_status anneal_model_arch_register(const anneal_model_arch *a);
/* The architecture called name, or NULL (no error recorded). */
const anneal_model_arch *anneal_model_arch_find(const char *name);
/* The architecture that reads Hugging Face model_type mt, or NULL. */
const anneal_model_arch *anneal_model_arch_for_hf(const char *model_type);
/* The registered architectures (n set to their count), in registration order. */
const anneal_model_arch *const *anneal_model_archs(int *n);

/* A preset of any architecture ("tiny", "124M", ...): false for an unknown name. */
bool anneal_model_preset(const char *name, anneal_model_config *out);
/* Every preset name of every architecture, ", "-separated, into buf ("tiny, d6, 124M,
 * ..."); returns buf. */
const char *anneal_model_preset_names(char *buf, size_t n);
/* Reads a Hugging Face config.json (its "model_type" picks the architecture; a config
 * without one is GPT-2's; a type no architecture reads is ANNEAL_ERR_UNSUPPORTED naming
 * the file and the types known): errors name the file. */
anneal_status anneal_model_config_from_hf_file(const char *path, anneal_model_config *out);
/* The same from the JSON text (source names it in errors). */
anneal_status anneal_model_config_from_hf_json(const char *json, const char *source,
                                               anneal_model_config *out);
/* The config.json text of cfg (malloc'd; NULL + error). */
char *anneal_model_config_to_hf_json(const anneal_model_config *cfg);
/* Checks cfg with its architecture's rules (an unknown arch is ANNEAL_ERR_ARG). */
anneal_status anneal_model_config_check(const anneal_model_config *cfg);

/* ------------------------------------------------------------- a model */

/* A new model of cfg's architecture on device dev with zero parameters. */
anneal_model *anneal_model_new(const anneal_model_config *cfg, anneal_device dev);
void anneal_model_free(anneal_model *m);
anneal_status anneal_model_init(anneal_model *m, uint64_t seed);
anneal_tensor *anneal_model_loss(anneal_model *m, anneal_tensor *ids, anneal_tensor *targets);
anneal_tensor *anneal_model_logits(anneal_model *m, anneal_tensor *ids);
/* Number of parameters (a tied embedding counted once). */
int64_t anneal_model_num_params(const anneal_model *m);
double anneal_model_flops_per_token(const anneal_model *m, int64_t T);
/* The device the parameters live on. */
anneal_device anneal_model_device(const anneal_model *m);
/* Matrix-product precision of the forward passes (F32, BF16 or F16), recorded on each
 * autograd node so backward runs at the forward's. ANNEAL_ERR_ARG otherwise. */
anneal_status anneal_model_set_compute(anneal_model *m, anneal_dtype compute);
/* Dropout on (training) or off. */
void anneal_model_set_training(anneal_model *m, bool training);
anneal_status anneal_model_hf_import(anneal_model *m, const anneal_tensor_source *src);
anneal_status anneal_model_hf_export(const anneal_model *m, const anneal_tensor_sink *sink);
/* The model's forward graph into g (see anneal_model_ops.onnx_graph), built in a scope
 * of its own; ANNEAL_ERR_UNSUPPORTED naming the architecture when it has no ONNX
 * export, or naming what the exporter cannot express (a LoRA adapter). */
anneal_status anneal_model_onnx_graph(const anneal_model *m, anneal_onnx_graph *g, bool kv_cache);

/* Pipeline stages (src/models/stage.c): see anneal_model_ops.stage_forward; checks
 * 0 <= first < last <= n_layer, and ANNEAL_ERR_UNSUPPORTED naming the architecture
 * when it has no stages. */
anneal_tensor *anneal_model_stage_forward(anneal_model *m, int first, int last, anneal_tensor *in,
                                          anneal_tensor *targets);
/* Whether m can be split into pipeline stages. */
bool anneal_model_has_stages(const anneal_model *m);
/* See anneal_model_ops.param_span. */
void anneal_model_param_span(const anneal_model *m, int i, int *first, int *last);

/* A cache for `batch` sequences of up to max_len positions (1 <= max_len <= n_ctx, else
 * ANNEAL_ERR_ARG); free it with anneal_kv_cache_free. */
anneal_kv_cache *anneal_model_kv_cache_new(anneal_model *m, int64_t batch, int64_t max_len);
/* Logits (B, T_new, vocab) of i32 ids (B, T_new) placed after the cached positions,
 * which then include them; equal to the last T_new rows of anneal_model_logits on the
 * whole sequence. Runs without autograd and dropout; every intermediate dies inside,
 * only the logits join the caller's scope. A cache of another model, another batch
 * size, or too many positions for max_len is an error (ANNEAL_ERR_ARG / _SHAPE), the
 * cache unchanged. */
anneal_tensor *anneal_model_forward_cached(anneal_model *m, anneal_kv_cache *kv, anneal_tensor *ids);
/* The same, with the logits of the last `rows` new rows only (B, rows, vocab) (rows <= 0
 * or > T_new: all): a prompt's prefill wants the last row, not T_new x vocab logits. */
anneal_tensor *anneal_model_forward_cached_last(anneal_model *m, anneal_kv_cache *kv, anneal_tensor *ids,
                                                int64_t rows);

/* Storage of the KV caches anneal_model_kv_cache_new makes from now on: ANNEAL_F32
 * (the default), ANNEAL_BF16 or ANNEAL_I8 (see anneal_kv_cache_new_dtype); attention
 * reads the stored dtype. ANNEAL_ERR_ARG otherwise. */
anneal_status anneal_model_set_kv_dtype(anneal_model *m, anneal_dtype kv_dtype);

/* Quantizes m's lm head to int8 per row (anneal_nn_quantize_head on "lm_head.weight",
 * else the tied embedding "transformer.wte.weight" / "model.embed_tokens.weight"), after
 * anneal_nn_quantize: logits, the loss and the decode engine then read the int8 head
 * (src/models/head_quant.c). ANNEAL_ERR_UNSUPPORTED when no head weight is found. */
anneal_status anneal_model_quantize_head(anneal_model *m);

/* ------------------------------------------- slots (continuous batching)
 *
 * A cache made by anneal_model_kv_cache_new(m, slots, max_len) ("batch" = slots) holds
 * `slots` independent sequences, each with its own length: a server prefills a request
 * into a free slot, then advances every active slot by one token per decode step. */
/* Empties one slot (len 0). */
void anneal_kv_cache_slot_reset(anneal_kv_cache *kv, int64_t slot);
/* Positions cached in slot. */
int64_t anneal_kv_cache_slot_len(const anneal_kv_cache *kv, int64_t slot);
/* Prefill: the n ids appended to slot `slot` (batched GEMMs over the n rows; under bf16
 * compute on the CPU the decode engine's chunks over its bf16 weight copies); returns
 * the logits (1, vocab) f32 of the last one, in the caller's scope. No autograd, no
 * dropout; intermediates die inside. ANNEAL_ERR_ARG for a slot out of range, n < 1 or
 * past max_len / n_ctx (cache unchanged). */
anneal_tensor *anneal_model_prefill_slot(anneal_model *m, anneal_kv_cache *kv, int64_t slot, const int32_t *ids,
                                         int64_t n);
/* One decode step for n distinct slots: ids[i] appended to slot slots[i]; logits (n,
 * vocab) f32, row i for slots[i]; equal (f32: to rounding of independent rows) to what
 * each slot alone gives. Errors (ANNEAL_ERR_ARG: slot out of range, repeated slot, a full
 * slot, an id outside the vocabulary; cache unchanged). On the CPU the step runs the
 * decode engine (src/models/decode_engine.c: GEMV over the weights, attention reading
 * the cache's dtype); elsewhere, one cached forward per slot. */
anneal_tensor *anneal_model_decode_slots(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                         const int32_t *ids, int64_t n);
/* Continuous batching's mixed step: entry i appends counts[i] >= 1 ids to slot slots[i]
 * (n distinct slots; the entries' ids one after another in ids): new prompts and
 * running sequences' next tokens at once. Logits (n, vocab) f32, row i after entry i's
 * last id; equal (to rounding) to prefilling each prompt and stepping the single ids.
 * Errors as anneal_model_decode_slots and _prefill_slot (ANNEAL_ERR_ARG, cache
 * unchanged). On the CPU, one pass of the decode engine over the weights for all rows
 * where they fit its prefill chunk (256 rows for GPT-2 124M, plus one per slot) and the
 * weights are bf16 copies or int8, or the prompts hold at most 16 rows (f32); otherwise,
 * or on another device, the prompts are prefilled one by one and the single ids stepped
 * together. */
anneal_tensor *anneal_model_extend_slots(anneal_model *m, anneal_kv_cache *kv, const int64_t *slots,
                                         const int32_t *ids, const int64_t *counts, int64_t n);

/* ------------------------------------------------------- loss over batches */

/* Fills ids and targets (host buffers of batch * seq i32 each) with batch number i of
 * an evaluation; *rows = how many rows are real (the rest are ignored). */
typedef anneal_status (*anneal_batch_fn)(void *user, int64_t i, int32_t *ids, int32_t *targets,
                                         int64_t *rows);

/* The mean next-token loss over n batches of (batch, seq) from next(): with dropout off
 * and no autograd, rows past *rows of a batch ignored (a last, partial batch), every
 * real target weighted equally. *tokens = the targets counted. One shared definition
 * for the trainer's validation, `anneal eval` and benchmarks. */
anneal_status anneal_model_evaluate(anneal_model *m, int64_t batch, int64_t seq, int64_t n,
                                    anneal_batch_fn next, void *user, double *loss,
                                    int64_t *tokens);

/* ------------------------------------------------------------ generation */

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
 * n_ctx/2 tokens and generation continues. Runs under no-grad with dropout off. */
anneal_status anneal_model_generate(anneal_model *m, const int32_t *prompt, int64_t n_prompt,
                                    int64_t max_new, const anneal_sampler_config *cfg,
                                    int32_t stop_id, anneal_token_fn on_token, void *user);

#ifdef __cplusplus
}
#endif
#endif

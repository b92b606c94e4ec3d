/* The Llama family (Llama, Mistral, Qwen2), shared by llama.c (the model) and
 * llama_hf.c (its Hugging Face config.json and weight translation). */
#ifndef ANNEAL_LLAMA_INTERNAL_H
#define ANNEAL_LLAMA_INTERNAL_H

#include "anneal/model.h"

struct anneal_llama;

/* One decoder layer: x + o_proj(attn(RMSNorm(x))), then + down(silu(gate h) * up h) of
 * h = RMSNorm(x). Field order is transformers' LlamaDecoderLayer's (its parameter
 * order). */
typedef struct anneal_llama_block {
    const struct anneal_llama *model; /* back-pointer: a block is its own recompute context */
    int layer;
    anneal_nn_attention attn;                /* model.layers.<l>.self_attn.{q,k,v,o}_proj */
    anneal_nn_mlp mlp;                       /* .mlp.{gate,up,down}_proj */
    anneal_nn_rms_norm input_layernorm;      /* .input_layernorm */
    anneal_nn_rms_norm post_attention_layernorm; /* .post_attention_layernorm */
} anneal_llama_block;

typedef struct anneal_llama {
    anneal_model base;              /* first: an anneal_llama * is an anneal_model * */
    anneal_nn_embedding embed;      /* model.embed_tokens (vocab, C); the lm head when tied */
    anneal_llama_block *blocks;     /* n_layer */
    anneal_nn_rms_norm norm;        /* model.norm */
    anneal_nn_dense lm_head;        /* lm_head (vocab, C), weight NULL when tied */
    anneal_rope_desc rope;          /* the rotary embedding every layer applies */
} anneal_llama;

/* The Hugging Face model_type of c ("llama" when c leaves it empty). */
const char *anneal_llama_hf_type(const anneal_model_config *c);
/* Reads a LlamaConfig / MistralConfig / Qwen2Config config.json text (see llama_hf.c). */
anneal_status anneal_llama_config_from_hf(const char *json, const char *source, anneal_model_config *out);
/* The config.json text of c (malloc'd), in the form transformers' save_pretrained writes
 * for c's model_type. */
char *anneal_llama_config_to_hf(const anneal_model_config *c);
/* Weights from a transformers state dict (model.embed_tokens.weight, model.layers.N...,
 * model.norm.weight, lm_head.weight): see model.h's hf_import. */
anneal_status anneal_llama_hf_import(anneal_model *m, const anneal_tensor_source *src);
/* Writes every parameter under its transformers name (no lm_head.weight when tied, as
 * save_pretrained writes tied weights once). */
anneal_status anneal_llama_hf_export(const anneal_model *m, const anneal_tensor_sink *sink);
/* The forward graph for ONNX export (llama_onnx.c; the model interface's onnx_graph). */
anneal_status anneal_llama_onnx_graph(const anneal_model *m, anneal_onnx_graph *g, bool kv_cache);

#endif

/* GPT-2's Hugging Face translation (gpt2_hf.c), the entries of anneal_gpt2_arch and
 * its ops table. */
#ifndef ANNEAL_MODELS_GPT2_HF_H
#define ANNEAL_MODELS_GPT2_HF_H

#include "anneal/gpt2.h"

/* transformers' GPT2Config JSON text -> config (see docs/FORMATS.md "config.json"). */
anneal_status anneal_gpt2_config_from_hf(const char *json, const char *source, anneal_model_config *out);
/* The config.json text save_pretrained writes for c (malloc'd; NULL + error). */
char *anneal_gpt2_config_to_hf(const anneal_model_config *c);
/* Weights of a GPT2LMHeadModel / GPT2Model state dict into m. */
anneal_status anneal_gpt2_hf_import(anneal_model *m, const anneal_tensor_source *src);
/* Every parameter under its name (the tied lm_head.weight omitted, as transformers does). */
anneal_status anneal_gpt2_hf_export(const anneal_model *m, const anneal_tensor_sink *sink);
/* GPT-2's forward graph for ONNX export (gpt2_onnx.c; the model interface's onnx_graph). */
anneal_status anneal_gpt2_onnx_graph(const anneal_model *m, anneal_onnx_graph *g, bool kv_cache);

#endif

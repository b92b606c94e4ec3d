/* anneal peft: LoRA adapters as a PEFT directory (what peft's
 * PeftModel.from_pretrained(base, dir) loads and save_pretrained writes):
 * adapter_config.json (peft_type "LORA", r, lora_alpha, target_modules, lora_dropout,
 * fan_in_fan_out, bias "none", task_type "CAUSAL_LM", base_model_name_or_path) and
 * adapter_model.safetensors with "base_model.model.<prefix>.lora_A.weight" (r, in) and
 * ".lora_B.weight" (out, r) tensors. */
#ifndef ANNEAL_PEFT_H
#define ANNEAL_PEFT_H

#include "anneal/io.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What adapter_config.json says (targets malloc'd; anneal_peft_config_free). */
typedef struct anneal_peft_config {
    int rank;
    float alpha, dropout;
    bool fan_in_fan_out;
    char **targets;
    int n_targets;
    char base_model[1024]; /* base_model_name_or_path ("" when null) */
} anneal_peft_config;

void anneal_peft_config_free(anneal_peft_config *c);
/* Reads and validates dir/adapter_config.json: peft_type "LORA", r a positive integer,
 * lora_alpha > 0, lora_dropout in [0, 1), target_modules a non-empty list of names,
 * bias "none", no rslora/DoRA/rank or alpha patterns/layers_to_transform/modules_to_save
 * (ANNEAL_ERR_UNSUPPORTED naming the field), errors naming the file and the field. */
anneal_status anneal_peft_read_config(const char *dir, anneal_peft_config *out);

/* Writes ps's adapters (anneal_lora_apply) to dir (created if missing; each file
 * atomically): adapter_config.json with base_model (may be NULL) and fan_in_fan_out
 * true when the adapted layers have Conv1D's (in, out) weights, and the f32 tensors. */
anneal_status anneal_peft_save(const char *dir, const anneal_params *ps, const char *base_model);

/* The adapter_config.json text (malloc'd; NULL + ANNEAL_ERR_OOM) for adapters made with
 * lora, base_model (NULL: null). */
char *anneal_peft_config_json(const anneal_params_lora *lora, const char *base_model, bool fan_in_fan_out);
/* True when some adapted layer of ps has Conv1D's (in, out) weight (PEFT's fan_in_fan_out). */
bool anneal_peft_fan_in_fan_out(const anneal_params *ps);
/* PEFT's key of parameter `name` of the model ("base_model.model.<name>"). */
#define ANNEAL_PEFT_KEY_PREFIX "base_model.model."

/* Loads a PEFT LoRA directory into ps: without adapters yet, applies its config
 * (anneal_lora_apply with base_dtype); with adapters, the config's r, alpha and targets
 * must be theirs. Every adapter tensor must be in the file with its shape for r (a
 * missing one, a shape that is not (r, in) / (out, r), or a tensor that is no adapter
 * of the model is an error naming the file and the tensor); float dtypes converted.
 * Nothing is written into ps until every tensor checked out. */
anneal_status anneal_peft_load(const char *dir, anneal_params *ps, anneal_dtype base_dtype);

#ifdef __cplusplus
}
#endif
#endif

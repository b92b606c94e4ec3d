/* Shared by the files of src/models. */
#ifndef ANNEAL_MODELS_INTERNAL_H
#define ANNEAL_MODELS_INTERNAL_H

#include "anneal/model.h"

/* The library's own architectures (registry.c), NULL-ended. */
extern const anneal_model_arch *const anneal_builtin_archs[];

/* The GGUF tables of the built-in architectures (gpt2_gguf.c, llama_gguf.c). */
extern const anneal_gguf_arch anneal_gpt2_gguf;
extern const anneal_gguf_arch anneal_llama_gguf;

/* One block's forward (block_scope.c): block is the architecture's block, kv NULL for
 * training. */
typedef anneal_tensor *(*anneal_model_block_fn)(const void *block, anneal_tensor *x, anneal_kv_cache *kv);
/* fn(block, x, kv) in a scope of its own: what the block made and no backward node saved
 * is freed when it returns; its output joins the caller's scope. */
anneal_tensor *anneal_model_scoped_block(anneal_model_block_fn fn, const void *block, anneal_tensor *x,
                                         anneal_kv_cache *kv);
/* Test switch: false runs every block in the caller's scope, as before (default true). */
void anneal_model_block_scopes_set(bool on);

/* ------------------------------------------ shared by the HF importers
 * (hf_import.c): what every architecture's hf_import checks the same way. */

/* Appends name to a "a, b, c (and N more)" list of at most 5 names in buf (n bytes);
 * *count counts every name given. */
void anneal_hf_name_list_add(char *buf, size_t n, int *count, const char *name);
/* Ends such a list: " (and K more)" when more than 5 names were given. */
void anneal_hf_name_list_finish(char *buf, size_t n, int count);
/* Sets *same to whether tensors a and b of src hold the same values once converted to
 * f32 (false when either is absent, their shapes differ or one is not a float; the
 * temporaries join the current scope). */
anneal_status anneal_hf_same_as_f32(const anneal_tensor_source *src, const char *a, const char *b, bool *same);
/* Every parameter i of m has a source tensor seen[i] of its shape and a float dtype
 * (ANNEAL_ERR_FORMAT / ANNEAL_ERR_DTYPE naming the source and the tensor). */
anneal_status anneal_hf_check_entries(const anneal_model *m, const anneal_tensor_source *src, const char **seen);
/* Every parameter i of m was matched (seen[i] set): ANNEAL_ERR_FORMAT listing the
 * missing ones otherwise. */
anneal_status anneal_hf_check_missing(const anneal_model *m, const anneal_tensor_source *src, const char **seen);
/* Copies source tensor seen[i] into every parameter i of m, converted to f32 on m's
 * device, after checking every shape and dtype first (anneal_hf_check_entries), so a
 * bad tensor leaves m unwritten. Parameters without storage (a --pp stage's model) are
 * checked but not read. */
anneal_status anneal_hf_load_matched(anneal_model *m, const anneal_tensor_source *src, const char **seen);
/* Puts every parameter of m into sink under its own (Hugging Face) name, in order: the
 * export of an architecture whose parameter names are transformers' keys. */
anneal_status anneal_hf_export_params(const anneal_model *m, const anneal_tensor_sink *sink);

#endif

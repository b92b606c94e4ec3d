/* anneal io: safetensors files (the Hugging Face format: 8-byte little-endian
 * header length, a JSON header of {name: {dtype, shape, data_offsets}} plus an
 * optional "__metadata__" map of strings, then the raw little-endian data).
 * Readers validate every size and offset; writers are atomic (temp + fsync + rename). */
#ifndef ANNEAL_IO_H
#define ANNEAL_IO_H

#include "anneal/core.h"
#include "anneal/model.h"
#include "anneal/nn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One tensor entry of a safetensors file. */
typedef struct anneal_st_entry {
    char *name;
    anneal_dtype dtype;
    int ndim;
    int64_t shape[ANNEAL_MAX_DIMS];
    uint64_t begin, end; /* byte offsets into the data section, end - begin = numel * size */
} anneal_st_entry;

/* An open, memory-mapped, validated safetensors file. */
typedef struct anneal_safetensors {
    char *path;
    int n_entries;
    anneal_st_entry *entries;   /* in file order of their data offsets */
    int n_metadata;
    char **metadata_keys;       /* "__metadata__" string map */
    char **metadata_values;
    void *map;                  /* whole file mapping */
    size_t map_size;
    const uint8_t *data;        /* start of the data section */
    uint64_t data_size;
} anneal_safetensors;

/* Opens and validates `path`: header length within the file, JSON well formed,
 * known dtypes (F32, BF16, F16, I32, I64, U16, U8, I8), shapes with at most
 * ANNEAL_MAX_DIMS non-negative dims, offsets inside the data section, sizes that
 * match dtype x shape, no overlapping entries, no duplicate names. Errors name the
 * file and the problem (ANNEAL_ERR_IO / ANNEAL_ERR_FORMAT). */
anneal_status anneal_safetensors_open(const char *path, anneal_safetensors **out);
/* The entry called `name`, or NULL. */
const anneal_st_entry *anneal_safetensors_find(const anneal_safetensors *st, const char *name);
/* Pointer to an entry's bytes inside the mapping. */
const void *anneal_safetensors_data(const anneal_safetensors *st, const anneal_st_entry *e);
/* Metadata value for key, or NULL. */
const char *anneal_safetensors_meta(const anneal_safetensors *st, const char *key);
/* Unmaps and frees (NULL is fine). */
void anneal_safetensors_close(anneal_safetensors *st);

/* A tensor to write: raw little-endian contiguous bytes of dtype x shape. */
typedef struct anneal_st_write_entry {
    const char *name;
    anneal_dtype dtype;
    int ndim;
    const int64_t *shape;
    const void *data;
} anneal_st_write_entry;

/* Writes a safetensors file atomically: to "<path>.tmp.<pid>", fsync, rename, fsync
 * of the directory. Metadata is n_meta string pairs (may be 0). On failure the
 * previous file at `path` is untouched and the temporary is removed. */
anneal_status anneal_safetensors_write(const char *path, int n, const anneal_st_write_entry *entries,
                                       int n_meta, const char *const *meta_keys,
                                       const char *const *meta_values);

/* The bytes of entry e (dtype x shape) when anneal_safetensors_write_fetch writes it:
 * *data valid until the next call. */
typedef anneal_status (*anneal_st_fetch_fn)(void *ctx, const anneal_st_write_entry *e, const void **data);
/* As anneal_safetensors_write; an entry whose data is NULL gets it from fetch when it is
 * written, in entry order, so a file can be written one tensor in memory at a time. */
anneal_status anneal_safetensors_write_fetch(const char *path, int n, const anneal_st_write_entry *entries,
                                             int n_meta, const char *const *meta_keys,
                                             const char *const *meta_values, anneal_st_fetch_fn fetch,
                                             void *fetch_ctx);

/* Loads entry `name` into a new tensor (owned by the current scope), converting
 * to dtype `want` when it differs and conversion is between float types.
 * Fails with a message naming the file and entry when missing or mismatched. */
anneal_tensor *anneal_safetensors_load(const anneal_safetensors *st, const char *name,
                                       anneal_dtype want);

/* Copies every parameter of ps from st. The entry for parameter "NAME" is looked up
 * as "<prefix>NAME", then (for Hugging Face files written without the model prefix)
 * "<prefix>NAME" with a leading "transformer." removed. Shapes must match exactly;
 * float dtypes are converted. A missing or mismatched entry is an error naming the
 * file, entry and shapes; parameters are only written once every entry checks out. */
anneal_status anneal_params_load(anneal_params *ps, const anneal_safetensors *st, const char *prefix);
/* Writes every parameter of ps (f32, registered names) to path atomically. */
anneal_status anneal_params_save(const anneal_params *ps, const char *path, int n_meta,
                                 const char *const *meta_keys, const char *const *meta_values);

/* ------------------------------------------------ models from and to files */

/* A model interface tensor source (model.h) over an open safetensors file: its
 * entries by name, float dtypes converted to f32 on the CPU. The file must stay open
 * while the source is used. */
typedef struct anneal_st_source {
    anneal_tensor_source src;
    const anneal_safetensors *st;
    const char **names; /* the entries' names (malloc'd array) */
} anneal_st_source;

/* Fills s for st (ANNEAL_ERR_OOM); anneal_st_source_free releases it. */
anneal_status anneal_st_source_init(anneal_st_source *s, const anneal_safetensors *st);
void anneal_st_source_free(anneal_st_source *s);

/* Reads a Hugging Face weights file (safetensors) into m through its architecture's
 * hf_import: every parameter checked before any is written; errors name the file. */
anneal_status anneal_model_load_safetensors(anneal_model *m, const char *path);
/* Writes m's weights as its architecture exports them (hf_export: Hugging Face names,
 * f32, metadata {"format": "pt"}) to path atomically. */
anneal_status anneal_model_save_safetensors(const anneal_model *m, const char *path);

/* ------------------------------------------ Hugging Face model directories */

/* The weights of a Hugging Face model: a single model.safetensors or a sharded set
 * named by model.safetensors.index.json, every file memory-mapped (tensors are
 * converted to f32 from the mapping when read, nothing is copied up front). */
typedef struct anneal_hf_weights anneal_hf_weights;

/* Opens path: a model directory (model.safetensors, else model.safetensors.index.json,
 * transformers' order), a .safetensors file or an index .json. The index is checked
 * before any tensor is read: weight_map entries are strings naming files inside the
 * directory (no absolute path or "..", no symlink out of it), every shard exists and
 * is valid safetensors, each tensor the index names is in its shard, no tensor is
 * listed twice or held by a shard the index does not map it to. A PyTorch pickle
 * (pytorch_model.bin, a directory with only that) is ANNEAL_ERR_UNSUPPORTED saying to
 * convert it to safetensors. Errors name the file and the tensor. */
anneal_status anneal_hf_weights_open(const char *path, anneal_hf_weights **out);
/* The tensor source over the set (valid until close): float dtypes (F32, BF16, F16)
 * converted to f32; `what` is the index or file path. */
const anneal_tensor_source *anneal_hf_weights_source(const anneal_hf_weights *w);
void anneal_hf_weights_close(anneal_hf_weights *w);

/* The config.json of a model directory, or beside a weights file, into out;
 * ANNEAL_ERR_IO naming the directory when there is none. */
anneal_status anneal_hf_config_path(const char *path, char *out, size_t n);
/* A new model on dev from a Hugging Face model directory (or a weights file with
 * config.json beside it): the config through the registry (model_type picks the
 * architecture), the weights through its hf_import. */
anneal_status anneal_model_load_hf(const char *path, anneal_device dev, anneal_model **out);
/* Reads the weights at path (directory, file or index) into m through hf_import. */
anneal_status anneal_model_load_hf_weights(anneal_model *m, const char *path);

struct anneal_tokenizer;

/* How anneal_model_save_hf writes a model directory. */
typedef struct anneal_hf_save_opts {
    anneal_dtype dtype;           /* tensors stored as ANNEAL_F32 (0), ANNEAL_BF16 or ANNEAL_F16 */
    uint64_t max_shard_bytes;     /* above this, shards + index as transformers names them; 0: one file */
    const struct anneal_tokenizer *tokenizer; /* written as tokenizer.json + tokenizer_config.json; NULL: none */
} anneal_hf_save_opts;

/* Writes m as a Hugging Face model directory `dir` that
 * transformers.AutoModelForCausalLM.from_pretrained(dir) loads: config.json (the
 * architecture's config_to_hf, torch_dtype set), generation_config.json, the weights
 * (model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json
 * when they exceed max_shard_bytes, split as transformers' shard_checkpoint does), the
 * tokenizer's files. Tensors are streamed from hf_export: the host holds one shard at a
 * time, not the model. The whole directory is written as "<dir>.tmp.<pid>" (every file
 * fsync'ed), then renamed to dir and the parent fsync'ed: dir appears complete or not
 * at all. dir must not exist or be an empty directory; on failure nothing is left. */
anneal_status anneal_model_save_hf(const anneal_model *m, const char *dir, const anneal_hf_save_opts *opts);

/* ------------------------------------------------------------ ONNX export */

/* Above this many bytes of initializers an ONNX file keeps them in external data
 * (protobuf messages are limited to 2 GiB; the rest is room for the graph). */
#define ANNEAL_ONNX_INLINE_MAX_BYTES 2000000000ULL

/* How anneal_onnx_save / anneal_model_save_onnx write. */
typedef struct anneal_onnx_save_opts {
    bool kv_cache;      /* anneal_model_save_onnx: past_key_values.N.* inputs, present.N.* outputs */
    bool external_data; /* every weight in "<path>.data" beside the file, even below the limit */
    uint64_t inline_max_bytes; /* the automatic limit; 0: ANNEAL_ONNX_INLINE_MAX_BYTES */
} anneal_onnx_save_opts;

/* Writes g as an ONNX ModelProto (IR ANNEAL_ONNX_IR_VERSION, opset ANNEAL_ONNX_OPSET,
 * producer "anneal") to path: every weight as f32 raw data (bf16/f16 tensors converted,
 * transposed ones transposed), in the file or, with external_data or above
 * inline_max_bytes of weights in all, in "<path>.data" (location = its base name, offsets
 * 64-byte aligned) with the small constants left inline. Each file is written to a
 * temporary, fsync'ed and renamed; on failure nothing is left at path. */
anneal_status anneal_onnx_save(const anneal_onnx_graph *g, const char *path, const anneal_onnx_save_opts *opts);
/* The model's forward graph (anneal_model_onnx_graph) written with anneal_onnx_save. */
anneal_status anneal_model_save_onnx(const anneal_model *m, const char *path, const anneal_onnx_save_opts *opts);

/* ------------------------------------------------ quantized model directories */

/* The quant_method of anneal's int8 model directories (docs/FORMATS.md). */
#define ANNEAL_QUANT_METHOD "anneal-int8"

/* What anneal_quant_save records beside the weights. */
typedef struct anneal_quant_save_opts {
    const struct anneal_tokenizer *tokenizer; /* tokenizer.json + tokenizer_config.json; NULL: none */
    const char *calib_method;                 /* static: "minmax" or "percentile" (NULL: not recorded) */
    double percentile;
    int calib_batches;
} anneal_quant_save_opts;

/* Writes the quantized model m (anneal_nn_quantize done) as a directory: config.json
 * with "quantization_config", model.safetensors with the int8 weights and their scales
 * and every other tensor in f32, the tokenizer. dir must not exist or be empty; written
 * whole and renamed into place. */
anneal_status anneal_quant_save(const anneal_model *m, const char *dir, const anneal_quant_save_opts *o);
/* True when the model directory (or the directory of a weights file) path has a
 * config.json with a "quantization_config" record (what anneal_quant_load reads). */
bool anneal_quant_dir_is_quantized(const char *path);
/* A new model on dev from a quantized directory: the config through the registry, the
 * unquantized tensors through the architecture's hf_import, then each listed dense
 * layer's int8 weight, scales and static input scale, every dtype and shape checked
 * (errors name the file and the tensor or key: an unknown mode or method, a group size
 * that does not divide a layer's in-features, scales of the wrong shape, ...). */
anneal_status anneal_quant_load(const char *path, anneal_device dev, anneal_model **out);

#ifdef __cplusplus
}
#endif
#endif

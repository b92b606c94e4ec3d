/* GGUF (llama.cpp's model file, version 3; version 2 read too): a strict reader that
 * maps the file and checks every count, length, offset, type and size against it
 * before anything is allocated or read, a writer (metadata key/values and tensors in
 * F32, F16, BF16 or Q8_0, data aligned to general.alignment, written atomically), and
 * models in and out: the architecture's table (anneal_gguf_arch in model.h) gives the
 * tensor names and layouts llama.cpp's convert_hf_to_gguf.py writes, the tokenizer goes
 * in tokenizer.ggml.*. Layer io. The format is described in docs/FORMATS.md. */
#ifndef ANNEAL_GGUF_H
#define ANNEAL_GGUF_H

#include "anneal/model.h"
#include "anneal/tokenizer.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Metadata value types (gguf_type). */
typedef enum anneal_gguf_vtype {
    ANNEAL_GGUF_UINT8 = 0,
    ANNEAL_GGUF_INT8 = 1,
    ANNEAL_GGUF_UINT16 = 2,
    ANNEAL_GGUF_INT16 = 3,
    ANNEAL_GGUF_UINT32 = 4,
    ANNEAL_GGUF_INT32 = 5,
    ANNEAL_GGUF_FLOAT32 = 6,
    ANNEAL_GGUF_BOOL = 7,
    ANNEAL_GGUF_STRING = 8,
    ANNEAL_GGUF_ARRAY = 9,
    ANNEAL_GGUF_UINT64 = 10,
    ANNEAL_GGUF_INT64 = 11,
    ANNEAL_GGUF_FLOAT64 = 12,
} anneal_gguf_vtype;

/* Tensor types anneal reads and writes (ggml_type numbers); others are refused by name. */
typedef enum anneal_ggml_type {
    ANNEAL_GGML_F32 = 0,
    ANNEAL_GGML_F16 = 1,
    ANNEAL_GGML_Q8_0 = 8,
    ANNEAL_GGML_BF16 = 30,
} anneal_ggml_type;

#define ANNEAL_GGUF_DEFAULT_ALIGNMENT 32
#define ANNEAL_GGUF_MAX_DIMS 4
#define ANNEAL_GGUF_QK8_0 32 /* weights per Q8_0 block: an f16 scale + 32 int8 */

/* A string inside the mapped file (not NUL-terminated). */
typedef struct anneal_gguf_str {
    const char *s;
    uint64_t n;
} anneal_gguf_str;

/* One metadata entry. Scalars: val points at the value's bytes (little-endian). Strings:
 * str. Arrays: arr_type, arr_n and val at the first element (strings: each a u64
 * length + bytes, walk them with anneal_gguf_array_str). */
typedef struct anneal_gguf_kv {
    anneal_gguf_str key;
    anneal_gguf_vtype type;
    anneal_gguf_str str;
    anneal_gguf_vtype arr_type;
    uint64_t arr_n;
    const uint8_t *val;
    const uint8_t **arr_strs; /* arrays of strings: each element's start, checked (else NULL) */
} anneal_gguf_kv;

/* One tensor: ne[0] is the innermost (contiguous) dimension, as ggml counts. */
typedef struct anneal_gguf_tensor {
    anneal_gguf_str name;
    char *cname; /* NUL-terminated copy of name */
    int n_dims;
    int64_t ne[ANNEAL_GGUF_MAX_DIMS];
    anneal_ggml_type type;
    uint64_t offset; /* from the data section's start, a multiple of the alignment */
    uint64_t nbytes;
    const uint8_t *data;
} anneal_gguf_tensor;

/* An open (mapped or borrowed) GGUF file. */
typedef struct anneal_gguf {
    char *path;
    const uint8_t *base;
    uint64_t size;
    bool mapped;
    uint32_t version;
    uint32_t alignment;
    int64_t n_kv, n_tensors;
    anneal_gguf_kv *kv;
    anneal_gguf_tensor *tensors;
    uint64_t data_offset; /* start of the tensor data section */
} anneal_gguf;

/* Maps path and parses it: ANNEAL_ERR_IO when it cannot be read, ANNEAL_ERR_FORMAT
 * (naming the file, the entry and what is wrong) for anything malformed: the magic,
 * a version other than 2 or 3, counts or string lengths larger than the file could
 * hold, unknown value or tensor types, an alignment that is not a power of two, a
 * tensor's offset misaligned or its data past the end of the file, shape x type
 * overflows, duplicate keys or tensor names, tensors overlapping. */
anneal_status anneal_gguf_open(const char *path, anneal_gguf **out);
/* The same over size bytes in memory (borrowed: they must outlive the result); what
 * names it in errors. */
anneal_status anneal_gguf_open_memory(const void *data, size_t size, const char *what, anneal_gguf **out);
void anneal_gguf_close(anneal_gguf *g);

/* The entry with this key, or NULL. */
const anneal_gguf_kv *anneal_gguf_find_kv(const anneal_gguf *g, const char *key);
/* The tensor with this name, or NULL. */
const anneal_gguf_tensor *anneal_gguf_find_tensor(const anneal_gguf *g, const char *name);
/* Integer value of an unsigned/signed integer entry of any width (false: absent, not
 * an integer, or out of int64 range). */
bool anneal_gguf_get_int(const anneal_gguf *g, const char *key, int64_t *v);
/* Float value of a FLOAT32/FLOAT64 entry (false: absent or another type). */
bool anneal_gguf_get_float(const anneal_gguf *g, const char *key, double *v);
/* A STRING entry (false: absent or another type). */
bool anneal_gguf_get_str(const anneal_gguf *g, const char *key, anneal_gguf_str *v);
/* A BOOL entry (false: absent or another type). */
bool anneal_gguf_get_bool(const anneal_gguf *g, const char *key, bool *v);
/* Element i of an array of strings. */
anneal_gguf_str anneal_gguf_array_str(const anneal_gguf_kv *kv, uint64_t i);
/* The bytes a tensor of ne (n_dims) of type takes, false on overflow or a first
 * dimension that is not a multiple of the block size. */
bool anneal_gguf_type_nbytes(anneal_ggml_type type, int n_dims, const int64_t *ne, uint64_t *out);
/* A tensor type's name ("f32", "q8_0", ...; "?" otherwise). */
const char *anneal_ggml_type_name(anneal_ggml_type t);
/* Converts a tensor's data to f32 (numel floats into out). */
anneal_status anneal_gguf_tensor_to_f32(const anneal_gguf_tensor *t, float *out);

/* ------------------------------------------------------------------ writing */

typedef struct anneal_gguf_writer anneal_gguf_writer;

/* A new writer (alignment 0: 32). */
anneal_gguf_writer *anneal_gguf_writer_new(uint32_t alignment);
void anneal_gguf_writer_free(anneal_gguf_writer *w);
/* Metadata, in the order added (the key is copied; a repeated key is ANNEAL_ERR_ARG). */
anneal_status anneal_gguf_put_u32(anneal_gguf_writer *w, const char *key, uint32_t v);
anneal_status anneal_gguf_put_i32(anneal_gguf_writer *w, const char *key, int32_t v);
anneal_status anneal_gguf_put_f32(anneal_gguf_writer *w, const char *key, float v);
anneal_status anneal_gguf_put_bool(anneal_gguf_writer *w, const char *key, bool v);
anneal_status anneal_gguf_put_str(anneal_gguf_writer *w, const char *key, const char *s, size_t n);
/* Arrays (copied): strings with their lengths, int32, float32. */
anneal_status anneal_gguf_put_str_array(anneal_gguf_writer *w, const char *key, int64_t n, const char *const *s,
                                        const size_t *len);
anneal_status anneal_gguf_put_i32_array(anneal_gguf_writer *w, const char *key, int64_t n, const int32_t *v);
anneal_status anneal_gguf_put_f32_array(anneal_gguf_writer *w, const char *key, int64_t n, const float *v);
/* A tensor of f32 data in numpy order (shape[0] outermost, as the converter's arrays),
 * stored as type (F32, F16, BF16, Q8_0: the last dimension a multiple of 32). The
 * data is converted now; the writer keeps only the stored bytes. */
anneal_status anneal_gguf_put_tensor(anneal_gguf_writer *w, const char *name, int ndim, const int64_t *shape,
                                     anneal_ggml_type type, const float *data);
/* Writes version 3 to path atomically (temp + fsync + rename). */
anneal_status anneal_gguf_writer_save(anneal_gguf_writer *w, const char *path);

/* Q8_0 of n floats (n a multiple of 32) as llama.cpp's quantize_row_q8_0_ref: per block
 * d = amax / 127 stored as f16, q = round(x / d) (half away from zero). */
void anneal_gguf_quantize_q8_0(const float *x, int64_t n, uint8_t *out);

/* ------------------------------------------------------------------ models */

typedef struct anneal_gguf_save_opts {
    anneal_ggml_type type;            /* of the 2-D weights (F32, F16, BF16, Q8_0); 1-D stay F32 */
    const anneal_tokenizer *tokenizer;/* NULL: no tokenizer.ggml.* keys */
    const char *name;                 /* general.name (NULL: "anneal <arch>") */
} anneal_gguf_save_opts;

/* Writes m as llama.cpp's converter would (its architecture's anneal_gguf_arch: names,
 * transposes, Q/K row permutation, hyperparameter keys; F32 norms and biases, and the
 * position embedding), with the tokenizer as tokenizer.ggml.*. An architecture without
 * a GGUF table, or a setting llama.cpp's architecture cannot express, is
 * ANNEAL_ERR_UNSUPPORTED naming it. */
anneal_status anneal_model_save_gguf(const anneal_model *m, const char *path, const anneal_gguf_save_opts *opts);
/* Reads a GGUF file into a new model on dev (weights dequantized to f32) and, when tok
 * is not NULL, its tokenizer (*tok NULL when the file has none). An architecture anneal
 * has no table for is ANNEAL_ERR_UNSUPPORTED naming it and those it has. */
anneal_status anneal_model_load_gguf(const char *path, anneal_device dev, anneal_model **out, anneal_tokenizer **tok);
/* The tokenizer of a GGUF file alone (*tok NULL, ANNEAL_OK, when it has none). */
anneal_status anneal_gguf_load_tokenizer(const char *path, anneal_tokenizer **tok);
/* True when path ends in ".gguf" (case-insensitive). */
bool anneal_gguf_path(const char *path);

#ifdef __cplusplus
}
#endif
#endif

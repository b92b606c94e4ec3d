/* Shared by the GGUF model export (gguf_export.c) and import (gguf_import.c): the
 * architecture tables' name matching and the tensor layouts (gguf_map.c). */
#ifndef ANNEAL_IO_GGUF_INTERNAL_H
#define ANNEAL_IO_GGUF_INTERNAL_H

#include "anneal/gguf.h"

/* The entry of a's table whose Hugging Face side (from_hf) or GGUF side matches name
 * ("%d" = a layer number); the other side's name, layer filled in, goes to to[0..n).
 * NULL when no entry matches. */
const anneal_gguf_name *anneal_gguf_map_name(const anneal_gguf_arch *a, const char *name, bool from_hf, char *to,
                                             size_t n);
/* dst = src with layout lay applied (to_gguf) or undone; shape is the Hugging Face shape
 * (ndim 1 or 2), heads the Q/K permutation's head count. ANNEAL_ERR_SHAPE naming the
 * tensor when the shape does not fit the layout. */
anneal_status anneal_gguf_relayout(anneal_gguf_layout lay, bool to_gguf, int ndim, const int64_t *shape, int heads,
                                   const float *src, float *dst, const char *name);
/* The number of heads a Q/K permutation runs over (0 for other layouts). */
int anneal_gguf_layout_heads(anneal_gguf_layout lay, const anneal_model_config *c);

#endif

/* The GGUF name maps and tensor layouts: matching a name against an architecture's
 * table ("%d" for the layer) and the transposes and per-head Q/K row permutations that
 * llama.cpp's converter applies (gguf_internal.h). */
#include "gguf_internal.h"

#include <stdio.h>
#include <string.h>

/* Matches name against pattern (one "%d" at most): true with *layer (-1 if none). */
static bool match(const char *pattern, const char *name, int *layer) {
    const char *pd = strstr(pattern, "%d");
    *layer = -1;
    if (!pd) return !strcmp(pattern, name);
    size_t pre = (size_t)(pd - pattern), suf = strlen(pd + 2), n = strlen(name);
    if (n <= pre + suf || strncmp(name, pattern, pre) || strcmp(name + n - suf, pd + 2)) return false;
    int v = 0;
    for (size_t i = pre; i < n - suf; i++) {
        if (name[i] < '0' || name[i] > '9' || v > 100000) return false;
        v = v * 10 + (name[i] - '0');
    }
    if (n - suf - pre > 1 && name[pre] == '0') return false;
    *layer = v;
    return true;
}

/* The table entry whose `from` side (HF or GGUF) matches name; *to set to the other side. */
const anneal_gguf_name *anneal_gguf_map_name(const anneal_gguf_arch *a, const char *name, bool from_hf, char *to, size_t n) {
    for (const anneal_gguf_name *e = a->names; e->hf; e++) {
        int layer;
        if (!match(from_hf ? e->hf : e->gguf, name, &layer)) continue;
        const char *pat = from_hf ? e->gguf : e->hf;
        if (layer >= 0) snprintf(to, n, pat, layer);
        else snprintf(to, n, "%s", pat);
        return e;
    }
    return NULL;
}

/* Row permutation between Hugging Face's rotate-half and ggml's interleaved RoPE
 * (the converter's permute: reshape(heads, 2, hd/2, ...).swapaxes(1, 2)): row r of the
 * GGUF tensor is row src_row(r) of the Hugging Face one. */
static int64_t gguf_row_to_hf(int64_t r, int64_t hd) {
    int64_t h = r / hd, k = r % hd, i = k / 2, j = k % 2;
    return h * hd + j * (hd / 2) + i;
}

/* dst = src with the layout applied (to_gguf) or undone; shape is the HF shape. */
anneal_status anneal_gguf_relayout(anneal_gguf_layout lay, bool to_gguf, int ndim, const int64_t *shape, int heads,
                              const float *src, float *dst, const char *name) {
    int64_t rows = shape[0], cols = ndim > 1 ? shape[1] : 1, n = rows * cols;
    switch (lay) {
    case ANNEAL_GGUF_SAME: memcpy(dst, src, (size_t)n * sizeof *dst); return ANNEAL_OK;
    case ANNEAL_GGUF_TRANSPOSED:
        if (ndim != 2) return anneal_set_error(ANNEAL_ERR_SHAPE, "gguf: %s: a transposed tensor must be 2-D", name);
        /* to_gguf: HF (rows, cols) -> (cols, rows); back: the file's (cols, rows) -> (rows, cols) */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                if (to_gguf) dst[c * rows + r] = src[r * cols + c];
                else dst[r * cols + c] = src[c * rows + r];
            }
        return ANNEAL_OK;
    case ANNEAL_GGUF_PERMUTE_Q:
    case ANNEAL_GGUF_PERMUTE_K: {
        if (heads <= 0 || rows % heads || (rows / heads) % 2)
            return anneal_set_error(ANNEAL_ERR_SHAPE, "gguf: %s: %lld rows do not split into %d heads of even size", name,
                                    (long long)rows, heads);
        int64_t hd = rows / heads;
        for (int64_t r = 0; r < rows; r++) {
            int64_t h = gguf_row_to_hf(r, hd);
            if (to_gguf) memcpy(dst + r * cols, src + h * cols, (size_t)cols * sizeof *dst);
            else memcpy(dst + h * cols, src + r * cols, (size_t)cols * sizeof *dst);
        }
        return ANNEAL_OK;
    }
    }
    return anneal_set_error(ANNEAL_ERR_ARG, "gguf: %s: unknown layout %d", name, (int)lay);
}

/* The number of heads a Q/K permutation runs over (0 for other layouts). */
int anneal_gguf_layout_heads(anneal_gguf_layout lay, const anneal_model_config *c) {
    if (lay == ANNEAL_GGUF_PERMUTE_Q) return c->n_head;
    if (lay == ANNEAL_GGUF_PERMUTE_K) return c->n_kv_head ? c->n_kv_head : c->n_head;
    return 0;
}

/* Strided iteration helper for elementwise kernels (see strided.h). */
#include "strided.h"

void anneal_strided_init(anneal_strided_iter *it, int ndim, const int64_t *shape, int n_ops,
                         const int64_t *const *strides) {
    it->n_ops = n_ops;
    int nd = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        if (nd > 0) {
            bool merge = true;
            for (int o = 0; o < n_ops; o++)
                if (it->strides[o][nd - 1] != strides[o][d] * shape[d]) merge = false;
            if (merge) {
                it->shape[nd - 1] *= shape[d];
                for (int o = 0; o < n_ops; o++) it->strides[o][nd - 1] = strides[o][d];
                continue;
            }
        }
        it->shape[nd] = shape[d];
        for (int o = 0; o < n_ops; o++) it->strides[o][nd] = strides[o][d];
        nd++;
    }
    bool empty = false;
    for (int d = 0; d < ndim; d++) empty |= shape[d] == 0;
    if (nd == 0 || empty) { /* a scalar (all dims 1) or no elements at all */
        nd = 1;
        it->shape[0] = empty ? 0 : 1;
        for (int o = 0; o < n_ops; o++) it->strides[o][0] = 0;
    }
    it->ndim = nd;
    it->inner = it->shape[nd - 1];
    it->rows = 1;
    for (int d = 0; d < nd - 1; d++) it->rows *= it->shape[d];
    if (it->inner == 0) it->rows = 0;
    it->piece = it->inner < ANNEAL_STRIDED_PIECE ? (it->inner > 0 ? it->inner : 1) : ANNEAL_STRIDED_PIECE;
    it->pieces = (it->inner + it->piece - 1) / it->piece;
}

void anneal_strided_row(const anneal_strided_iter *it, int64_t r, int64_t *offsets) {
    for (int o = 0; o < it->n_ops; o++) offsets[o] = 0;
    for (int d = it->ndim - 2; d >= 0; d--) {
        int64_t i = r % it->shape[d];
        r /= it->shape[d];
        for (int o = 0; o < it->n_ops; o++) offsets[o] += i * it->strides[o][d];
    }
}

int64_t anneal_strided_item(const anneal_strided_iter *it, int64_t w, int64_t *offsets) {
    const int64_t r = w / it->pieces, k0 = w % it->pieces * it->piece;
    anneal_strided_row(it, r, offsets);
    for (int o = 0; o < it->n_ops; o++) offsets[o] += k0 * it->strides[o][it->ndim - 1];
    return it->inner - k0 < it->piece ? it->inner - k0 : it->piece;
}

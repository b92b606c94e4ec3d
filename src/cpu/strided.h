/* Strided iteration for CPU elementwise kernels: up to 3 operands sharing one shape,
 * each with its own element strides. Dims are coalesced (adjacent dims merged when
 * every operand's strides allow, size-1 dims dropped) so the common cases become a
 * single inner loop over contiguous or broadcast (stride 0) memory. */
#ifndef ANNEAL_CPU_STRIDED_H
#define ANNEAL_CPU_STRIDED_H

#include "anneal/core.h"

typedef struct anneal_strided_iter {
    int ndim;                                /* after coalescing; >= 1 */
    int n_ops;
    int64_t shape[ANNEAL_MAX_DIMS];
    int64_t strides[3][ANNEAL_MAX_DIMS];
    int64_t rows;                            /* product of all dims but the last */
    int64_t inner;                           /* size of the last dim */
    int64_t piece;                           /* elements of an item (anneal_strided_item) */
    int64_t pieces;                          /* items per row */
} anneal_strided_iter;

/* Builds an iterator over `shape` for n_ops operands with the given strides. */
void anneal_strided_init(anneal_strided_iter *it, int ndim, const int64_t *shape, int n_ops,
                         const int64_t *const *strides);
/* Element offsets of each operand at the start of row r (0 <= r < rows). */
void anneal_strided_row(const anneal_strided_iter *it, int64_t r, int64_t *offsets);
/* Work items: the rows cut into pieces of at most ANNEAL_STRIDED_PIECE elements, so that
 * a tensor the coalescing makes one long row (every contiguous one) still spreads over
 * the threads of a parallel loop over the items. */
#define ANNEAL_STRIDED_PIECE 65536
static inline int64_t anneal_strided_items(const anneal_strided_iter *it) { return it->rows * it->pieces; }
/* Offsets of each operand at the start of item w (0 <= w < anneal_strided_items) and its
 * length; the inner strides are it->strides[o][it->ndim - 1] as for rows. */
int64_t anneal_strided_item(const anneal_strided_iter *it, int64_t w, int64_t *offsets);

#endif

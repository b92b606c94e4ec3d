/* The deterministic tensor-parallel projections (tp_det.c) as the nn table's entries
 * (user: the group, NULL for one process), for tp.c's table. */
#ifndef ANNEAL_PARALLEL_TP_DET_H
#define ANNEAL_PARALLEL_TP_DET_H

#include "anneal/parallel.h"

anneal_tensor *anneal_tp_det_nn_col(void *user, anneal_tensor *x, anneal_tensor *w, anneal_tensor *b,
                                    anneal_weight_layout layout, int parts, int chunks, anneal_dtype compute);
anneal_tensor *anneal_tp_det_nn_row(void *user, anneal_tensor *x, anneal_tensor *w, anneal_weight_layout layout,
                                    int chunks, anneal_dtype compute);

#endif

/* Embedding, LayerNorm and RMSNorm blocks: their parameters (never weight-decayed)
 * and a forward that is the op. */
#include "nn_internal.h"

anneal_status anneal_nn_embedding_create(anneal_nn_embedding *e, anneal_params *ps, const char *prefix, int64_t n,
                                         int64_t dim) {
    if (!e || !ps) return anneal_set_error(ANNEAL_ERR_ARG, "nn embedding %s: NULL block or parameter set", prefix);
    e->weight = anneal_nn_param(ps, prefix, "weight", 2, (int64_t[]){n, dim}, false);
    return e->weight ? ANNEAL_OK : anneal_last_status();
}

anneal_tensor *anneal_nn_embedding_forward(const anneal_nn_embedding *e, anneal_tensor *ids) {
    return e ? anneal_embedding(ids, e->weight) : NULL;
}

anneal_status anneal_nn_layer_norm_create(anneal_nn_layer_norm *n, anneal_params *ps, const char *prefix,
                                          int64_t dim, float eps, bool bias) {
    if (!n || !ps) return anneal_set_error(ANNEAL_ERR_ARG, "nn layer_norm %s: NULL block or parameter set", prefix);
    *n = (anneal_nn_layer_norm){.eps = eps};
    if (!(n->weight = anneal_nn_param(ps, prefix, "weight", 1, &dim, false))) return anneal_last_status();
    if (bias && !(n->bias = anneal_nn_param(ps, prefix, "bias", 1, &dim, false))) return anneal_last_status();
    return ANNEAL_OK;
}

anneal_tensor *anneal_nn_layer_norm_forward(const anneal_nn_layer_norm *n, anneal_tensor *x) {
    return n ? anneal_layer_norm(x, n->weight, n->bias, n->eps) : NULL;
}

anneal_tensor *anneal_nn_add_layer_norm(const anneal_nn_layer_norm *n, anneal_tensor *x, anneal_tensor *r,
                                        anneal_tensor **sum) {
    if (!n) {
        *sum = NULL;
        return NULL;
    }
    return anneal_add_layer_norm(x, r, n->weight, n->bias, n->eps, sum);
}

anneal_status anneal_nn_rms_norm_create(anneal_nn_rms_norm *n, anneal_params *ps, const char *prefix, int64_t dim,
                                        float eps) {
    if (!n || !ps) return anneal_set_error(ANNEAL_ERR_ARG, "nn rms_norm %s: NULL block or parameter set", prefix);
    *n = (anneal_nn_rms_norm){.eps = eps};
    n->weight = anneal_nn_param(ps, prefix, "weight", 1, &dim, false);
    return n->weight ? ANNEAL_OK : anneal_last_status();
}

anneal_tensor *anneal_nn_rms_norm_forward(const anneal_nn_rms_norm *n, anneal_tensor *x) {
    return n ? anneal_rms_norm(x, n->weight, n->eps) : NULL;
}

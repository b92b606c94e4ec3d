/* The ONNX graph builder (include/anneal/onnx.h): nodes, initializers and graph inputs
 * and outputs kept as plain arrays of owned strings, so io can serialize them and the
 * nn blocks and architectures can describe their forward passes without knowing the
 * protobuf. Names are made unique with a counter under the current prefix. */
#include "anneal/onnx.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

anneal_onnx_graph *anneal_onnx_graph_new(const char *name) {
    anneal_onnx_graph *g = calloc(1, sizeof *g);
    if (!g || !(g->name = strdup(name ? name : "anneal"))) {
        free(g);
        anneal_set_error(ANNEAL_ERR_OOM, "onnx graph: out of memory");
        return NULL;
    }
    return g;
}

void anneal_onnx_graph_free(anneal_onnx_graph *g) {
    if (!g) return;
    for (int i = 0; i < g->n_nodes; i++) {
        anneal_onnx_node_def *n = &g->nodes[i];
        free(n->inputs);
        free(n->outputs);
        free(n->attrs);
    }
    for (int i = 0; i < g->n_inits; i++) {
        if (g->inits[i].tensor) anneal_release(g->inits[i].tensor);
        free(g->inits[i].data);
    }
    for (int i = 0; i < g->n_strings; i++) free(g->strings[i]);
    free(g->strings);
    free(g->nodes);
    free(g->inits);
    free(g->inputs);
    free(g->outputs);
    free(g->name);
    free(g->doc);
    free(g);
}

anneal_status anneal_onnx_graph_status(const anneal_onnx_graph *g) {
    return g ? g->status : ANNEAL_ERR_ARG;
}

anneal_status anneal_onnx_graph_fail(anneal_onnx_graph *g, anneal_status s, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (g && g->status == ANNEAL_OK) {
        g->status = s;
        anneal_set_error(s, "onnx export: %s", msg);
    }
    return s;
}

void anneal_onnx_set_prefix(anneal_onnx_graph *g, const char *fmt, ...) {
    if (!g) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->prefix, sizeof g->prefix, fmt, ap);
    va_end(ap);
}

/* Grows *arr (element size sz) to hold one more than *n; false + graph error on OOM. */
static bool grow(anneal_onnx_graph *g, void **arr, int *cap, int n, size_t sz) {
    if (n < *cap) return true;
    int nc = *cap ? *cap * 2 : 64;
    void *p = realloc(*arr, (size_t)nc * sz);
    if (!p) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
        return false;
    }
    *arr = p;
    *cap = nc;
    return true;
}

/* A copy of s owned by g (NULL + graph error on OOM). */
static char *own(anneal_onnx_graph *g, const char *s) {
    if (!grow(g, (void **)&g->strings, &g->cap_strings, g->n_strings, sizeof *g->strings)) return NULL;
    char *c = strdup(s);
    if (!c) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
        return NULL;
    }
    g->strings[g->n_strings++] = c;
    return c;
}

/* A new unique name "<prefix>/<what>_<n>" owned by g. */
static char *fresh(anneal_onnx_graph *g, const char *what) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s%s%s_%lld", g->prefix, g->prefix[0] ? "/" : "", what, (long long)g->counter++);
    return own(g, buf);
}

/* Fills v with a value description; false on error. */
static bool describe(anneal_onnx_graph *g, anneal_onnx_value *v, const char *name, anneal_onnx_elem elem, int ndim,
                     const int64_t *dims, const char *const *dim_names) {
    memset(v, 0, sizeof *v);
    if (ndim < 0 || ndim > ANNEAL_MAX_DIMS) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "%s: %d dims", name, ndim);
        return false;
    }
    if (!(v->name = own(g, name))) return false;
    v->elem = elem;
    v->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        v->dims[i] = dims[i];
        if (dims[i] < 0 && !(v->dim_names[i] = own(g, dim_names && dim_names[i] ? dim_names[i] : "?"))) return false;
    }
    return true;
}

const char *anneal_onnx_input(anneal_onnx_graph *g, const char *name, anneal_onnx_elem elem, int ndim,
                              const int64_t *dims, const char *const *dim_names) {
    if (!g || g->status != ANNEAL_OK || !name) return NULL;
    if (!grow(g, (void **)&g->inputs, &g->cap_inputs, g->n_inputs, sizeof *g->inputs)) return NULL;
    anneal_onnx_value *v = &g->inputs[g->n_inputs];
    if (!describe(g, v, name, elem, ndim, dims, dim_names)) return NULL;
    g->n_inputs++;
    return v->name;
}

const char *anneal_onnx_output(anneal_onnx_graph *g, const char *value, const char *name, anneal_onnx_elem elem,
                               int ndim, const int64_t *dims, const char *const *dim_names) {
    if (!g || g->status != ANNEAL_OK || !value || !name) return NULL;
    if (strcmp(value, name)) {
        /* an Identity node whose output is called name */
        if (!grow(g, (void **)&g->nodes, &g->cap_nodes, g->n_nodes, sizeof *g->nodes)) return NULL;
        anneal_onnx_node_def *n = &g->nodes[g->n_nodes];
        memset(n, 0, sizeof *n);
        n->inputs = calloc(1, sizeof *n->inputs);
        n->outputs = calloc(1, sizeof *n->outputs);
        if (!n->inputs || !n->outputs) {
            free(n->inputs);
            free(n->outputs);
            anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
            return NULL;
        }
        n->n_in = n->n_out = 1;
        g->n_nodes++;
        if (!(n->op_type = own(g, "Identity")) || !(n->name = fresh(g, "Identity")) ||
            !(n->inputs[0] = own(g, value)) || !(n->outputs[0] = own(g, name)))
            return NULL;
    }
    if (!grow(g, (void **)&g->outputs, &g->cap_outputs, g->n_outputs, sizeof *g->outputs)) return NULL;
    anneal_onnx_value *v = &g->outputs[g->n_outputs];
    if (!describe(g, v, name, elem, ndim, dims, dim_names)) return NULL;
    g->n_outputs++;
    return v->name;
}

/* A new initializer slot named name (NULL on error). */
static anneal_onnx_initializer *new_init(anneal_onnx_graph *g, const char *name) {
    if (!grow(g, (void **)&g->inits, &g->cap_inits, g->n_inits, sizeof *g->inits)) return NULL;
    anneal_onnx_initializer *in = &g->inits[g->n_inits];
    memset(in, 0, sizeof *in);
    if (!(in->name = own(g, name))) return NULL;
    g->n_inits++;
    return in;
}

const char *anneal_onnx_weight(anneal_onnx_graph *g, const char *name, anneal_tensor *t, bool transpose) {
    if (!g || g->status != ANNEAL_OK) return NULL;
    if (!t || !name) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "weight %s: no tensor", name ? name : "(unnamed)");
        return NULL;
    }
    for (int i = 0; i < g->n_inits; i++) {
        if (strcmp(g->inits[i].name, name)) continue;
        if (g->inits[i].tensor != t || g->inits[i].transpose != transpose) {
            anneal_onnx_graph_fail(g, ANNEAL_ERR_ARG, "initializer %s given twice with different contents", name);
            return NULL;
        }
        return g->inits[i].name;
    }
    if (t->dtype != ANNEAL_F32 && t->dtype != ANNEAL_BF16 && t->dtype != ANNEAL_F16) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_DTYPE, "weight %s: dtype %s is not a float", name,
                               anneal_dtype_name(t->dtype));
        return NULL;
    }
    if (transpose && t->ndim != 2) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_SHAPE, "weight %s: only a 2-D tensor is stored transposed", name);
        return NULL;
    }
    anneal_onnx_initializer *in = new_init(g, name);
    if (!in) return NULL;
    in->elem = ANNEAL_ONNX_FLOAT;
    in->ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) in->dims[i] = t->shape[transpose ? t->ndim - 1 - i : i];
    in->tensor = anneal_retain(t);
    in->transpose = transpose;
    return in->name;
}

/* A constant initializer of elem with a copy of nbytes at v (0-D when ndim is 0). */
static const char *constant(anneal_onnx_graph *g, anneal_onnx_elem elem, int ndim, const int64_t *dims,
                            const void *v, size_t nbytes) {
    if (!g || g->status != ANNEAL_OK) return NULL;
    char *name = fresh(g, "const");
    anneal_onnx_initializer *in = name ? new_init(g, name) : NULL;
    if (!in) return NULL;
    in->elem = elem;
    in->ndim = ndim;
    for (int i = 0; i < ndim; i++) in->dims[i] = dims[i];
    if (!(in->data = malloc(nbytes ? nbytes : 1))) {
        anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
        return NULL;
    }
    if (nbytes) memcpy(in->data, v, nbytes);
    in->nbytes = nbytes;
    return in->name;
}

const char *anneal_onnx_ints(anneal_onnx_graph *g, int n, const int64_t *v) {
    int64_t d = n;
    return constant(g, ANNEAL_ONNX_INT64, 1, &d, v, (size_t)n * sizeof *v);
}

const char *anneal_onnx_int_scalar(anneal_onnx_graph *g, int64_t v) {
    return constant(g, ANNEAL_ONNX_INT64, 0, NULL, &v, sizeof v);
}

const char *anneal_onnx_floats(anneal_onnx_graph *g, int ndim, const int64_t *dims, const float *v) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= dims[i];
    return constant(g, ANNEAL_ONNX_FLOAT, ndim, dims, v, (size_t)n * sizeof *v);
}

const char *anneal_onnx_float_scalar(anneal_onnx_graph *g, float v) {
    return constant(g, ANNEAL_ONNX_FLOAT, 0, NULL, &v, sizeof v);
}

const char *anneal_onnx_node_n(anneal_onnx_graph *g, const char *op_type, int n_in, const char *const *in,
                               int n_out, const char **out, const anneal_onnx_attr *attrs, int n_attrs) {
    if (!g || g->status != ANNEAL_OK || !op_type || n_out < 1) return NULL;
    for (int i = 0; i < n_in; i++)
        if (!in[i]) return NULL; /* an earlier failure: NaN-like */
    if (!grow(g, (void **)&g->nodes, &g->cap_nodes, g->n_nodes, sizeof *g->nodes)) return NULL;
    anneal_onnx_node_def *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->inputs = calloc((size_t)(n_in ? n_in : 1), sizeof *n->inputs);
    n->outputs = calloc((size_t)n_out, sizeof *n->outputs);
    n->attrs = calloc((size_t)(n_attrs ? n_attrs : 1), sizeof *n->attrs);
    if (!n->inputs || !n->outputs || !n->attrs) {
        free(n->inputs);
        free(n->outputs);
        free(n->attrs);
        anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
        return NULL;
    }
    g->n_nodes++; /* the arrays are the graph's now, freed with it */
    n->n_in = n_in;
    n->n_out = n_out;
    n->n_attrs = n_attrs;
    if (!(n->op_type = own(g, op_type)) || !(n->name = fresh(g, op_type))) return NULL;
    for (int i = 0; i < n_in; i++)
        if (!(n->inputs[i] = own(g, in[i]))) return NULL;
    for (int i = 0; i < n_out; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s_out%d", op_type, i);
        if (!(n->outputs[i] = fresh(g, what))) return NULL;
        if (out) out[i] = n->outputs[i];
    }
    for (int i = 0; i < n_attrs; i++) {
        n->attrs[i] = attrs[i];
        n->attrs[i].ints = NULL;
        if (!(n->attrs[i].name = own(g, attrs[i].name))) return NULL;
        if (attrs[i].kind == 'I') {
            int64_t *c = calloc((size_t)(attrs[i].n ? attrs[i].n : 1), sizeof *c);
            /* kept in the string list: one free for every owned block */
            if (!c || !grow(g, (void **)&g->strings, &g->cap_strings, g->n_strings, sizeof *g->strings)) {
                free(c);
                if (g->status == ANNEAL_OK) anneal_onnx_graph_fail(g, ANNEAL_ERR_OOM, "out of memory");
                return NULL;
            }
            g->strings[g->n_strings++] = (char *)c;
            if (attrs[i].n) memcpy(c, attrs[i].ints, (size_t)attrs[i].n * sizeof *c);
            n->attrs[i].ints = c;
        }
    }
    return n->outputs[0];
}

const char *anneal_onnx_node(anneal_onnx_graph *g, const char *op_type, int n_in, const char *const *in,
                             const anneal_onnx_attr *attrs, int n_attrs) {
    return anneal_onnx_node_n(g, op_type, n_in, in, 1, NULL, attrs, n_attrs);
}

const char *anneal_onnx_op1(anneal_onnx_graph *g, const char *op_type, const char *a) {
    return anneal_onnx_node(g, op_type, 1, &a, NULL, 0);
}

const char *anneal_onnx_op2(anneal_onnx_graph *g, const char *op_type, const char *a, const char *b) {
    const char *in[2] = {a, b};
    return anneal_onnx_node(g, op_type, 2, in, NULL, 0);
}

const char *anneal_onnx_reshape(anneal_onnx_graph *g, const char *x, int n, const int64_t *shape) {
    return anneal_onnx_op2(g, "Reshape", x, anneal_onnx_ints(g, n, shape));
}

const char *anneal_onnx_transpose(anneal_onnx_graph *g, const char *x, int n, const int64_t *perm) {
    anneal_onnx_attr a = ANNEAL_ONNX_ATTR_INTS("perm", perm, n);
    return anneal_onnx_node(g, "Transpose", 1, &x, &a, 1);
}

/* ONNX files: an anneal_onnx_graph (include/anneal/onnx.h) as an ONNX ModelProto,
 * through the protobuf-c code protoc-c generates at build time from src/io/proto/
 * onnx.proto (ONNX 1.17's, package anneal.onnx). The message is packed straight into
 * the temporary file through a buffered ProtobufCBuffer (no second copy of the model in
 * memory); weights are f32 raw data, in the file or in "<path>.data" (external data:
 * location, offset, length), which is written first. */
#include "anneal/fs.h"
#include "anneal/io.h"
#include "onnx.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { EXTERNAL_ALIGN = 64, FILE_BUFFER = 1 << 20 };

/* ------------------------------------------ a ProtobufCBuffer into a file */

typedef struct file_buffer {
    ProtobufCBuffer base;
    anneal_atomic_file *af;
    uint8_t *buf;
    size_t n;
    anneal_status status;
} file_buffer;

/* Writes what is buffered; keeps the first error. */
static void fb_flush(file_buffer *fb) {
    if (fb->status == ANNEAL_OK && fb->n) fb->status = anneal_atomic_write(fb->af, fb->buf, fb->n);
    fb->n = 0;
}

/* protobuf-c's append: small pieces are buffered, large ones (weights) written through. */
static void fb_append(ProtobufCBuffer *b, size_t len, const uint8_t *data) {
    file_buffer *fb = (file_buffer *)b;
    if (fb->status != ANNEAL_OK) return;
    if (fb->n + len > FILE_BUFFER) fb_flush(fb);
    if (len >= FILE_BUFFER) {
        if (fb->status == ANNEAL_OK) fb->status = anneal_atomic_write(fb->af, data, len);
        return;
    }
    memcpy(fb->buf + fb->n, data, len);
    fb->n += len;
}

/* ------------------------------------------------------- weight bytes */

/* The f32 bytes of initializer in: *owned is set when they were made (free it). */
static anneal_status init_bytes(const anneal_onnx_initializer *in, const uint8_t **bytes, size_t *nbytes,
                                void **owned) {
    *owned = NULL;
    if (!in->tensor) {
        *bytes = in->data;
        *nbytes = in->nbytes;
        return ANNEAL_OK;
    }
    const anneal_tensor *t = in->tensor;
    int64_t n = anneal_numel(t);
    *nbytes = (size_t)n * sizeof(float);
    if (t->dtype == ANNEAL_F32 && t->device == ANNEAL_CPU && anneal_is_contiguous(t) && !in->transpose) {
        *bytes = anneal_data(t);
        return ANNEAL_OK;
    }
    float *f = malloc(*nbytes ? *nbytes : 1);
    if (!f) return anneal_set_error(ANNEAL_ERR_OOM, "onnx export: %s: out of memory", in->name);
    anneal_status s = anneal_to_f32_buffer(t, f);
    if (s == ANNEAL_OK && in->transpose) {
        /* t (R, C) row-major -> stored (C, R) */
        int64_t R = t->shape[0], C = t->shape[1];
        float *tt = malloc(*nbytes ? *nbytes : 1);
        if (!tt) {
            s = anneal_set_error(ANNEAL_ERR_OOM, "onnx export: %s: out of memory", in->name);
        } else {
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < C; c++) tt[c * R + r] = f[r * C + c];
            free(f);
            f = tt;
        }
    }
    if (s != ANNEAL_OK) {
        free(f);
        return s;
    }
    *bytes = (const uint8_t *)f;
    *owned = f;
    return ANNEAL_OK;
}

/* ------------------------------------------------------- the messages */

/* Everything the ModelProto points to, freed together. */
typedef struct proto_arena {
    void **blocks;
    int n, cap;
    bool oom;
} proto_arena;

/* calloc'd memory that lives until arena_free (NULL, arena->oom set, on failure). */
static void *arena_alloc(proto_arena *a, size_t n, size_t sz) {
    if (a->oom) return NULL;
    if (a->n == a->cap) {
        int nc = a->cap ? a->cap * 2 : 256;
        void **p = realloc(a->blocks, (size_t)nc * sizeof *p);
        if (!p) {
            a->oom = true;
            return NULL;
        }
        a->blocks = p;
        a->cap = nc;
    }
    void *m = calloc(n ? n : 1, sz);
    if (!m) {
        a->oom = true;
        return NULL;
    }
    a->blocks[a->n++] = m;
    return m;
}

/* Frees every block of the arena. */
static void arena_free(proto_arena *a) {
    for (int i = 0; i < a->n; i++) free(a->blocks[i]);
    free(a->blocks);
}

/* A ValueInfoProto of a graph input or output. */
static Anneal__Onnx__ValueInfoProto *value_info(proto_arena *a, const anneal_onnx_value *v) {
    Anneal__Onnx__ValueInfoProto *vi = arena_alloc(a, 1, sizeof *vi);
    Anneal__Onnx__TypeProto *tp = arena_alloc(a, 1, sizeof *tp);
    Anneal__Onnx__TypeProto__Tensor *tt = arena_alloc(a, 1, sizeof *tt);
    Anneal__Onnx__TensorShapeProto *sh = arena_alloc(a, 1, sizeof *sh);
    Anneal__Onnx__TensorShapeProto__Dimension *dims = arena_alloc(a, (size_t)v->ndim, sizeof *dims);
    Anneal__Onnx__TensorShapeProto__Dimension **dp = arena_alloc(a, (size_t)v->ndim, sizeof *dp);
    if (a->oom) return NULL;
    anneal__onnx__value_info_proto__init(vi);
    anneal__onnx__type_proto__init(tp);
    anneal__onnx__type_proto__tensor__init(tt);
    anneal__onnx__tensor_shape_proto__init(sh);
    for (int i = 0; i < v->ndim; i++) {
        anneal__onnx__tensor_shape_proto__dimension__init(&dims[i]);
        if (v->dims[i] >= 0) {
            dims[i].value_case = ANNEAL__ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_VALUE;
            dims[i].dim_value = v->dims[i];
        } else {
            dims[i].value_case = ANNEAL__ONNX__TENSOR_SHAPE_PROTO__DIMENSION__VALUE_DIM_PARAM;
            dims[i].dim_param = v->dim_names[i];
        }
        dp[i] = &dims[i];
    }
    sh->n_dim = (size_t)v->ndim;
    sh->dim = dp;
    tt->has_elem_type = true;
    tt->elem_type = (int32_t)v->elem;
    tt->shape = sh;
    tp->value_case = ANNEAL__ONNX__TYPE_PROTO__VALUE_TENSOR_TYPE;
    tp->tensor_type = tt;
    vi->name = v->name;
    vi->type = tp;
    return vi;
}

/* A NodeProto with its attributes. */
static Anneal__Onnx__NodeProto *node_proto(proto_arena *a, const anneal_onnx_node_def *n) {
    Anneal__Onnx__NodeProto *np = arena_alloc(a, 1, sizeof *np);
    Anneal__Onnx__AttributeProto *at = arena_alloc(a, (size_t)n->n_attrs, sizeof *at);
    Anneal__Onnx__AttributeProto **ap = arena_alloc(a, (size_t)n->n_attrs, sizeof *ap);
    if (a->oom) return NULL;
    anneal__onnx__node_proto__init(np);
    np->name = n->name;
    np->op_type = n->op_type;
    np->n_input = (size_t)n->n_in;
    np->input = n->inputs;
    np->n_output = (size_t)n->n_out;
    np->output = n->outputs;
    for (int i = 0; i < n->n_attrs; i++) {
        const anneal_onnx_attr *src = &n->attrs[i];
        Anneal__Onnx__AttributeProto *d = &at[i];
        anneal__onnx__attribute_proto__init(d);
        d->name = (char *)src->name;
        d->has_type = true;
        if (src->kind == 'i') {
            d->type = ANNEAL__ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INT;
            d->has_i = true;
            d->i = src->i;
        } else if (src->kind == 'f') {
            d->type = ANNEAL__ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__FLOAT;
            d->has_f = true;
            d->f = src->f;
        } else {
            d->type = ANNEAL__ONNX__ATTRIBUTE_PROTO__ATTRIBUTE_TYPE__INTS;
            d->n_ints = (size_t)src->n;
            d->ints = (int64_t *)src->ints;
        }
        ap[i] = d;
    }
    np->n_attribute = (size_t)n->n_attrs;
    np->attribute = ap;
    return np;
}

/* The base name of path (what external data's location holds). */
static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* Writes the weights that go external into the open temporary af of data_path,
 * filling their TensorProtos' external_data (location, offset, length); the caller
 * commits af once the model file is written too. */
static anneal_status write_external(const anneal_onnx_graph *g, const bool *ext, Anneal__Onnx__TensorProto *tp,
                                    anneal_atomic_file *daf, const char *data_path, proto_arena *a) {
    anneal_atomic_file af = *daf; /* the descriptor and names, still owned by the caller */
    anneal_status s = ANNEAL_OK;
    static const uint8_t zeros[EXTERNAL_ALIGN] = {0};
    const char *loc = base_name(data_path);
    uint64_t off = 0;
    for (int i = 0; i < g->n_inits && s == ANNEAL_OK; i++) {
        if (!ext[i]) continue;
        const uint8_t *bytes;
        size_t nb;
        void *owned;
        s = init_bytes(&g->inits[i], &bytes, &nb, &owned);
        if (s != ANNEAL_OK) break;
        size_t pad = (size_t)((EXTERNAL_ALIGN - off % EXTERNAL_ALIGN) % EXTERNAL_ALIGN);
        if (pad) s = anneal_atomic_write(&af, zeros, pad);
        off += pad;
        if (s == ANNEAL_OK) s = anneal_atomic_write(&af, bytes, nb);
        free(owned);
        Anneal__Onnx__StringStringEntryProto *e = arena_alloc(a, 3, sizeof *e);
        Anneal__Onnx__StringStringEntryProto **ep = arena_alloc(a, 3, sizeof *ep);
        char *offs = arena_alloc(a, 32, 1), *lens = arena_alloc(a, 32, 1);
        if (a->oom) {
            s = anneal_set_error(ANNEAL_ERR_OOM, "onnx export: out of memory");
            break;
        }
        snprintf(offs, 32, "%llu", (unsigned long long)off);
        snprintf(lens, 32, "%llu", (unsigned long long)nb);
        const char *keys[3] = {"location", "offset", "length"}, *vals[3] = {loc, offs, lens};
        for (int k = 0; k < 3; k++) {
            anneal__onnx__string_string_entry_proto__init(&e[k]);
            e[k].key = (char *)keys[k];
            e[k].value = (char *)vals[k];
            ep[k] = &e[k];
        }
        tp[i].has_data_location = true;
        tp[i].data_location = ANNEAL__ONNX__TENSOR_PROTO__DATA_LOCATION__EXTERNAL;
        tp[i].n_external_data = 3;
        tp[i].external_data = ep;
        off += nb;
    }
    return s;
}

anneal_status anneal_onnx_save(const anneal_onnx_graph *g, const char *path, const anneal_onnx_save_opts *opts) {
    if (!g || !path || !*path) return anneal_set_error(ANNEAL_ERR_ARG, "onnx export: NULL graph or empty path");
    if (g->status != ANNEAL_OK) return anneal_set_error(g->status, "onnx export: the graph failed to build");
    anneal_onnx_save_opts o = opts ? *opts : (anneal_onnx_save_opts){0};
    /* external data: forced, or when the weights would not fit a protobuf message */
    uint64_t total = 0;
    for (int i = 0; i < g->n_inits; i++)
        total += g->inits[i].tensor ? (uint64_t)anneal_numel(g->inits[i].tensor) * 4 : g->inits[i].nbytes;
    bool external = o.external_data || total > (o.inline_max_bytes ? o.inline_max_bytes : ANNEAL_ONNX_INLINE_MAX_BYTES);

    proto_arena a = {0};
    anneal_status s = ANNEAL_OK;
    char *data_path = NULL;
    anneal_atomic_file daf = {.fd = -1};
    void **owned = arena_alloc(&a, (size_t)g->n_inits, sizeof *owned);
    bool *ext = arena_alloc(&a, (size_t)g->n_inits, sizeof *ext);
    Anneal__Onnx__TensorProto *tp = arena_alloc(&a, (size_t)g->n_inits, sizeof *tp);
    Anneal__Onnx__TensorProto **tpp = arena_alloc(&a, (size_t)g->n_inits, sizeof *tpp);
    Anneal__Onnx__NodeProto **np = arena_alloc(&a, (size_t)g->n_nodes, sizeof *np);
    Anneal__Onnx__ValueInfoProto **in = arena_alloc(&a, (size_t)g->n_inputs, sizeof *in);
    Anneal__Onnx__ValueInfoProto **out = arena_alloc(&a, (size_t)g->n_outputs, sizeof *out);
    for (int i = 0; i < g->n_nodes && !a.oom; i++) np[i] = node_proto(&a, &g->nodes[i]);
    for (int i = 0; i < g->n_inputs && !a.oom; i++) in[i] = value_info(&a, &g->inputs[i]);
    for (int i = 0; i < g->n_outputs && !a.oom; i++) out[i] = value_info(&a, &g->outputs[i]);
    if (a.oom) {
        s = anneal_set_error(ANNEAL_ERR_OOM, "onnx export: %s: out of memory", path);
        goto done;
    }
    for (int i = 0; i < g->n_inits; i++) {
        const anneal_onnx_initializer *ini = &g->inits[i];
        anneal__onnx__tensor_proto__init(&tp[i]);
        tp[i].name = ini->name;
        tp[i].has_data_type = true;
        tp[i].data_type = (int32_t)ini->elem;
        tp[i].n_dims = (size_t)ini->ndim;
        tp[i].dims = (int64_t *)ini->dims;
        tpp[i] = &tp[i];
        ext[i] = external && ini->tensor != NULL;
    }
    if (external) {
        size_t n = strlen(path) + 6;
        if (!(data_path = arena_alloc(&a, n, 1))) {
            s = anneal_set_error(ANNEAL_ERR_OOM, "onnx export: out of memory");
            goto done;
        }
        snprintf(data_path, n, "%s.data", path);
        if ((s = anneal_atomic_open(&daf, data_path)) != ANNEAL_OK) goto done;
        if ((s = write_external(g, ext, tp, &daf, data_path, &a)) != ANNEAL_OK) goto done;
    }
    for (int i = 0; i < g->n_inits && s == ANNEAL_OK; i++) {
        if (ext[i]) continue;
        const uint8_t *bytes;
        size_t nb;
        s = init_bytes(&g->inits[i], &bytes, &nb, &owned[i]);
        tp[i].has_raw_data = true;
        tp[i].raw_data.len = nb;
        tp[i].raw_data.data = (uint8_t *)bytes;
    }
    if (s != ANNEAL_OK) goto done;

    Anneal__Onnx__GraphProto graph = ANNEAL__ONNX__GRAPH_PROTO__INIT;
    graph.name = g->name;
    graph.n_node = (size_t)g->n_nodes;
    graph.node = np;
    graph.n_initializer = (size_t)g->n_inits;
    graph.initializer = tpp;
    graph.n_input = (size_t)g->n_inputs;
    graph.input = in;
    graph.n_output = (size_t)g->n_outputs;
    graph.output = out;
    Anneal__Onnx__OperatorSetIdProto opset = ANNEAL__ONNX__OPERATOR_SET_ID_PROTO__INIT, *opsets[1] = {&opset};
    opset.domain = "";
    opset.has_version = true;
    opset.version = ANNEAL_ONNX_OPSET;
    Anneal__Onnx__ModelProto model = ANNEAL__ONNX__MODEL_PROTO__INIT;
    model.has_ir_version = true;
    model.ir_version = ANNEAL_ONNX_IR_VERSION;
    model.producer_name = "anneal";
    model.producer_version = ANNEAL_VERSION;
    model.doc_string = g->doc;
    model.n_opset_import = 1;
    model.opset_import = opsets;
    model.graph = &graph;

    anneal_atomic_file af = {.fd = -1};
    if ((s = anneal_atomic_open(&af, path)) != ANNEAL_OK) goto done;
    file_buffer fb = {.base = {.append = fb_append}, .af = &af, .buf = malloc(FILE_BUFFER), .status = ANNEAL_OK};
    if (!fb.buf) {
        anneal_atomic_abort(&af);
        s = anneal_set_error(ANNEAL_ERR_OOM, "onnx export: out of memory");
        goto done;
    }
    anneal__onnx__model_proto__pack_to_buffer(&model, &fb.base);
    fb_flush(&fb);
    free(fb.buf);
    s = fb.status;
    /* the data file first: a model file is never there without its data */
    if (s == ANNEAL_OK && data_path) s = anneal_atomic_commit(&daf);
    if (s == ANNEAL_OK) {
        s = anneal_atomic_commit(&af);
    } else {
        anneal_atomic_abort(&af);
    }
done:
    anneal_atomic_abort(&daf); /* after a commit: nothing left to do */
    if (owned)
        for (int i = 0; i < g->n_inits; i++) free(owned[i]);
    arena_free(&a);
    return s;
}

anneal_status anneal_model_save_onnx(const anneal_model *m, const char *path, const anneal_onnx_save_opts *opts) {
    if (!m || !path) return anneal_set_error(ANNEAL_ERR_ARG, "onnx export: NULL argument");
    anneal_onnx_graph *g = anneal_onnx_graph_new(m->cfg.arch);
    if (!g) return anneal_last_status();
    anneal_status s = anneal_model_onnx_graph(m, g, opts && opts->kv_cache);
    if (s == ANNEAL_OK) s = anneal_onnx_save(g, path, opts);
    anneal_onnx_graph_free(g);
    return s;
}

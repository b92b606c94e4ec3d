/* TensorBoard event files (see anneal/telemetry.h): Event protobufs encoded by
 * protobuf-c (src/obs/proto/tensorboard.proto, compiled at build time) in TFRecord
 * framing, one write(2) per record. */
#include "anneal/telemetry.h"

#include "tensorboard.pb-c.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

struct anneal_tb_writer {
    int fd;
    char path[PATH_MAX];
};

static double wall_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
}

/* mkdir -p. */
static anneal_status make_dirs(const char *dir) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
        return anneal_set_error(ANNEAL_ERR_ARG, "--tensorboard %s: path too long", dir);
    for (char *s = p + 1; ; s++) {
        if (*s == '/' || !*s) {
            char c = *s;
            *s = 0;
            if (mkdir(p, 0755) != 0 && errno != EEXIST)
                return anneal_set_error(ANNEAL_ERR_IO, "--tensorboard %s: cannot create %s: %s", dir, p, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    return ANNEAL_OK;
}

/* Packs ev and appends it as one TFRecord with one write. */
static anneal_status write_event(anneal_tb_writer *w, const Anneal__Tb__Event *ev) {
    size_t n = anneal__tb__event__get_packed_size(ev);
    unsigned char *buf = malloc(n + 16);
    if (!buf) return anneal_set_error(ANNEAL_ERR_OOM, "%s: out of memory", w->path);
    anneal_tfrecord_header(n, buf);
    anneal__tb__event__pack(ev, buf + 12);
    uint32_t c = anneal_crc32c_masked(buf + 12, n);
    for (int i = 0; i < 4; i++) buf[12 + n + (size_t)i] = (unsigned char)(c >> (8 * i));
    size_t total = n + 16, done = 0;
    anneal_status st = ANNEAL_OK;
    while (done < total) {
        ssize_t k = write(w->fd, buf + done, total - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            st = anneal_set_error(ANNEAL_ERR_IO, "%s: write failed: %s", w->path, k < 0 ? strerror(errno) : "no progress");
            break;
        }
        done += (size_t)k;
    }
    free(buf);
    return st;
}

anneal_status anneal_tb_open(const char *dir, anneal_tb_writer **out) {
    *out = NULL;
    if (!dir || !*dir) return anneal_set_error(ANNEAL_ERR_ARG, "--tensorboard: empty directory name");
    anneal_status st = make_dirs(dir);
    if (st != ANNEAL_OK) return st;
    anneal_tb_writer *w = calloc(1, sizeof *w);
    if (!w) return anneal_set_error(ANNEAL_ERR_OOM, "--tensorboard: out of memory");
    char host[64] = "localhost";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%lld.%s.%d.%09ld.anneal", dir, (long long)ts.tv_sec, host,
                 (int)getpid(), ts.tv_nsec) >= (int)sizeof w->path) {
        free(w);
        return anneal_set_error(ANNEAL_ERR_ARG, "--tensorboard %s: path too long", dir);
    }
    w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        st = anneal_set_error(ANNEAL_ERR_IO, "%s: cannot create: %s", w->path, strerror(errno));
        free(w);
        return st;
    }
    Anneal__Tb__Event ev = ANNEAL__TB__EVENT__INIT;
    ev.wall_time = wall_now();
    ev.what_case = ANNEAL__TB__EVENT__WHAT_FILE_VERSION;
    ev.file_version = "brain.Event:2";
    if ((st = write_event(w, &ev)) != ANNEAL_OK) {
        anneal_tb_close(w);
        return st;
    }
    *out = w;
    return ANNEAL_OK;
}

const char *anneal_tb_path(const anneal_tb_writer *w) { return w ? w->path : NULL; }

/* Writes an event holding one summary value. */
static anneal_status write_value(anneal_tb_writer *w, int64_t step, Anneal__Tb__Summary__Value *v) {
    Anneal__Tb__Summary sum = ANNEAL__TB__SUMMARY__INIT;
    Anneal__Tb__Summary__Value *vals[1] = {v};
    sum.n_value = 1;
    sum.value = vals;
    Anneal__Tb__Event ev = ANNEAL__TB__EVENT__INIT;
    ev.wall_time = wall_now();
    ev.step = step;
    ev.what_case = ANNEAL__TB__EVENT__WHAT_SUMMARY;
    ev.summary = &sum;
    return write_event(w, &ev);
}

anneal_status anneal_tb_scalar(anneal_tb_writer *w, const char *tag, int64_t step, double value) {
    if (!w || !tag) return anneal_set_error(ANNEAL_ERR_ARG, "tensorboard: NULL writer or tag");
    Anneal__Tb__Summary__Value v = ANNEAL__TB__SUMMARY__VALUE__INIT;
    v.tag = (char *)tag;
    v.value_case = ANNEAL__TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
    v.simple_value = (float)value;
    return write_value(w, step, &v);
}

anneal_status anneal_tb_text(anneal_tb_writer *w, const char *tag, int64_t step, const char *text) {
    if (!w || !tag || !text) return anneal_set_error(ANNEAL_ERR_ARG, "tensorboard: NULL writer, tag or text");
    Anneal__Tb__TensorShapeProto__Dim dim = ANNEAL__TB__TENSOR_SHAPE_PROTO__DIM__INIT;
    dim.size = 1;
    Anneal__Tb__TensorShapeProto__Dim *dims[1] = {&dim};
    Anneal__Tb__TensorShapeProto shape = ANNEAL__TB__TENSOR_SHAPE_PROTO__INIT;
    shape.n_dim = 1;
    shape.dim = dims;
    ProtobufCBinaryData sv = {strlen(text), (uint8_t *)text};
    Anneal__Tb__TensorProto tensor = ANNEAL__TB__TENSOR_PROTO__INIT;
    tensor.dtype = 7; /* DT_STRING */
    tensor.tensor_shape = &shape;
    tensor.n_string_val = 1;
    tensor.string_val = &sv;
    Anneal__Tb__SummaryMetadata__PluginData pd = ANNEAL__TB__SUMMARY_METADATA__PLUGIN_DATA__INIT;
    pd.plugin_name = "text";
    Anneal__Tb__SummaryMetadata md = ANNEAL__TB__SUMMARY_METADATA__INIT;
    md.plugin_data = &pd;
    Anneal__Tb__Summary__Value v = ANNEAL__TB__SUMMARY__VALUE__INIT;
    v.tag = (char *)tag;
    v.metadata = &md;
    v.value_case = ANNEAL__TB__SUMMARY__VALUE__VALUE_TENSOR;
    v.tensor = &tensor;
    return write_value(w, step, &v);
}

/* A numeric field of a record, or NaN when absent. */
static double num(const cJSON *o, const char *k) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(it) ? it->valuedouble : NAN;
}

/* Writes the scalar when the record has the (finite) field. */
static anneal_status scalar_from(anneal_tb_writer *w, const cJSON *r, const char *key, const char *tag, int64_t step) {
    double x = num(r, key);
    return isfinite(x) ? anneal_tb_scalar(w, tag, step, x) : ANNEAL_OK;
}

anneal_status anneal_tb_record(anneal_tb_writer *w, const cJSON *r) {
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(r, "type");
    if (!w || !cJSON_IsString(ty)) return ANNEAL_OK;
    double sx = num(r, "step");
    int64_t step = isfinite(sx) ? (int64_t)sx : 0;
    const char *type = ty->valuestring;
    anneal_status st = ANNEAL_OK;
    if (!strcmp(type, "step")) {
        static const char *const map[][2] = {{"loss", "train/loss"},           {"lr", "train/lr"},
                                             {"grad_norm", "train/grad_norm"}, {"loss_scale", "train/loss_scale"},
                                             {"tokens_per_s", "perf/tokens_per_s"}, {"mfu", "perf/mfu"},
                                             {"memory_bytes", "perf/memory_bytes"}};
        for (size_t i = 0; i < sizeof map / sizeof map[0] && st == ANNEAL_OK; i++)
            st = scalar_from(w, r, map[i][0], map[i][1], step);
    } else if (!strcmp(type, "eval")) {
        st = scalar_from(w, r, "val_loss", "val/loss", step);
    } else if (!strcmp(type, "sample")) {
        const cJSON *tx = cJSON_GetObjectItemCaseSensitive(r, "text");
        if (cJSON_IsString(tx)) st = anneal_tb_text(w, "samples", step, tx->valuestring);
    } else if (!strcmp(type, "start")) {
        const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(r, "config");
        char *s = cfg ? cJSON_Print(cfg) : NULL;
        if (s) {
            /* markdown: the settings as a code block */
            size_t n = strlen(s) + 16;
            char *md = malloc(n);
            if (md) {
                snprintf(md, n, "```\n%s\n```", s);
                st = anneal_tb_text(w, "config", step, md);
                free(md);
            }
            free(s);
        }
    }
    return st;
}

void anneal_tb_close(anneal_tb_writer *w) {
    if (!w) return;
    if (w->fd >= 0) {
        fsync(w->fd);
        close(w->fd);
    }
    free(w);
}

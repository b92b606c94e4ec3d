/* Finite-difference gradient checker (see gradcheck.h). */
#include "gradcheck.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 11;
}

anneal_tensor *anneal_test_rand(int ndim, const int64_t *shape, float lo, float hi, uint64_t seed,
                                bool requires_grad) {
    anneal_tensor *t = anneal_empty(ANNEAL_F32, ndim, shape);
    if (!t) return NULL;
    float *p = anneal_data(t);
    uint64_t s = seed * 2654435761ULL + 12345;
    for (int64_t i = 0; i < anneal_numel(t); i++)
        p[i] = lo + (hi - lo) * (float)((double)lcg(&s) / 9007199254740992.0);
    if (requires_grad) anneal_set_requires_grad(t, true);
    return t;
}

void anneal_test_set_grad(anneal_tensor *t, const float *vals) {
    anneal_scope_enter(NULL);
    anneal_tensor *g = anneal_from_data(ANNEAL_F32, t->ndim, t->shape, vals);
    anneal_scope_leave();
    anneal_grad_clear(t);
    t->grad = g;
}

/* L = sum(out * R) in double; R from a fixed seed. */
static double eval_loss(anneal_gc_fn f, void *ctx, int n, anneal_tensor *const *inputs, bool *ok) {
    anneal_scope *s = anneal_scope_open();
    anneal_no_grad_begin();
    anneal_tensor *out = f(ctx, inputs);
    anneal_no_grad_end();
    double L = 0;
    *ok = out != NULL;
    if (out) {
        int64_t m = anneal_numel(out);
        uint64_t seed = 99;
        for (int64_t i = 0; i < m; i++) {
            double r = (double)lcg(&seed) / 9007199254740992.0 * 2.0 - 1.0;
            L += anneal_item_at(out, i) * r;
        }
    }
    anneal_scope_close(s);
    return L;
}

/* Element j (row-major) of t as a pointer into its storage. */
static float *elem(anneal_tensor *t, int64_t j) {
    int64_t off = t->offset;
    for (int d = t->ndim - 1; d >= 0; d--) {
        off += (j % t->shape[d]) * t->strides[d];
        j /= t->shape[d];
    }
    return (float *)t->storage->data + off;
}

static double last_ratio;

double anneal_gradcheck_last_ratio(void) { return last_ratio; }

bool anneal_gradcheck(anneal_gc_fn f, void *ctx, int n, anneal_tensor *const *inputs, double eps,
                      double atol, double rtol, char *msg, size_t msg_len) {
    msg[0] = '\0';
    last_ratio = INFINITY;
    /* Analytic gradients. */
    for (int i = 0; i < n; i++) anneal_grad_clear(inputs[i]);
    anneal_scope *s = anneal_scope_open();
    anneal_tensor *out = f(ctx, inputs);
    bool ok = out != NULL;
    if (ok) {
        int64_t m = anneal_numel(out);
        float *r = malloc((size_t)(m ? m : 1) * sizeof *r);
        uint64_t seed = 99;
        for (int64_t i = 0; i < m; i++) r[i] = (float)((double)lcg(&seed) / 9007199254740992.0 * 2.0 - 1.0);
        /* The weights R must equal the double ones used numerically up to f32 rounding;
         * the loss is linear in out, so its gradient is exactly R. */
        anneal_tensor *R = anneal_from_data(ANNEAL_F32, out->ndim, out->shape, r);
        free(r);
        anneal_tensor *loss = anneal_sum(anneal_mul(out, R));
        ok = loss && anneal_backward(loss) == ANNEAL_OK;
    }
    anneal_scope_close(s);
    if (!ok) {
        snprintf(msg, msg_len, "forward/backward failed: %s", anneal_last_error());
        return false;
    }
    double worst = 0, all = 0;
    for (int i = 0; i < n; i++) {
        anneal_tensor *x = inputs[i];
        if (!x || !x->requires_grad) continue;
        if (!x->grad) {
            snprintf(msg, msg_len, "input %d got no gradient", i);
            return false;
        }
        for (int64_t j = 0; j < anneal_numel(x); j++) {
            float *p = elem(x, j);
            float orig = *p;
            bool ok1, ok2;
            *p = orig + (float)eps;
            double lp = eval_loss(f, ctx, n, inputs, &ok1);
            *p = orig - (float)eps;
            double lm = eval_loss(f, ctx, n, inputs, &ok2);
            *p = orig;
            double h = (double)(orig + (float)eps) - (double)(orig - (float)eps);
            double num = (lp - lm) / h;
            double ana = anneal_item_at(x->grad, j);
            double err = fabs(ana - num), lim = atol + rtol * fabs(num);
            if (ok1 && ok2 && err / lim > all) all = err / lim;
            if (!ok1 || !ok2 || !(err <= lim)) {
                if (!(err / lim <= worst)) {
                    worst = err / lim;
                    snprintf(msg, msg_len, "input %d element %lld: analytic %.7g numeric %.7g (atol %.2g rtol %.2g)",
                             i, (long long)j, ana, num, atol, rtol);
                }
            }
        }
    }
    last_ratio = msg[0] ? INFINITY : all;
    return msg[0] == '\0';
}

void anneal_gradcheck_report(const char *file, int line) {
    const char *r = getenv("ANNEAL_GRADCHECK_REPORT");
    if (r && r[0] == '1') fprintf(stderr, "gradcheck %s:%d worst %.4g of the tolerance\n", file, line, last_ratio);
}

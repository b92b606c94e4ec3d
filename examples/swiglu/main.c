/* Registers the SwiGLU custom op, runs it forward and backward on random inputs, and
 * compares output and gradients with the same function made of built-in ops
 * (anneal_mul(anneal_silu(a), b)). Prints the largest differences; exits 1 when one
 * is beyond float rounding (the two use different exp functions). */
#include "swiglu_op.h"

#include <math.h>
#include <stdio.h>

/* Largest |x - y| over the elements of two tensors of one shape; *close = false when
 * some element is beyond |x - y| <= 1e-6 + 1e-5 |y| (float rounding of both ways). */
static double max_abs_diff(const anneal_tensor *x, const anneal_tensor *y, bool *close) {
    double worst = 0;
    for (int64_t i = 0; i < anneal_numel(x); i++) {
        double u = anneal_item_at(x, i), v = anneal_item_at(y, i), d = fabs(u - v);
        if (!(d <= 1e-6 + 1e-5 * fabs(v))) *close = false;
        if (!(d <= worst)) worst = d;
    }
    return worst;
}

/* y = f(a, b), then the gradients of sum(y) into a->grad and b->grad. */
static anneal_tensor *run(bool custom, anneal_tensor *a, anneal_tensor *b) {
    anneal_grad_clear(a);
    anneal_grad_clear(b);
    anneal_tensor *y = custom ? swiglu(a, b) : anneal_mul(anneal_silu(a), b);
    if (!y || anneal_backward(anneal_sum(y)) != ANNEAL_OK) return NULL;
    return y;
}

int main(void) {
    if (swiglu_register() != ANNEAL_OK) {
        fprintf(stderr, "swiglu: %s\n", anneal_last_error());
        return 1;
    }
    anneal_scope *scope = anneal_scope_open();
    const int64_t shape[2] = {64, 1000};
    anneal_manual_seed(7);
    anneal_tensor *a = anneal_randn(ANNEAL_F32, 2, shape, 0.0f, 2.0f);
    anneal_tensor *b = anneal_randn(ANNEAL_F32, 2, shape, 0.0f, 1.0f);
    if (!a || !b || anneal_set_requires_grad(a, true) != ANNEAL_OK || anneal_set_requires_grad(b, true) != ANNEAL_OK) {
        fprintf(stderr, "swiglu: %s\n", anneal_last_error());
        return 1;
    }
    anneal_tensor *y_ref = run(false, a, b);
    anneal_tensor *da_ref = anneal_clone(a->grad), *db_ref = anneal_clone(b->grad);
    anneal_tensor *y = run(true, a, b);
    if (!y_ref || !da_ref || !db_ref || !y) {
        fprintf(stderr, "swiglu: %s\n", anneal_last_error());
        return 1;
    }
    bool ok = true;
    double dy = max_abs_diff(y, y_ref, &ok), da = max_abs_diff(a->grad, da_ref, &ok),
           db = max_abs_diff(b->grad, db_ref, &ok);
    printf("swiglu (64 x 1000) against anneal_mul(anneal_silu(a), b): largest absolute difference\n"
           "  y %.3g, da %.3g, db %.3g\n", dy, da, db);
    printf("%s\n", ok ? "ok: the fused op matches the composition of built-in ops"
                      : "MISMATCH: beyond float rounding");
    anneal_scope_close(scope);
    return ok ? 0 : 1;
}

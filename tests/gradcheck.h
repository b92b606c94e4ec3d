/* Finite-difference gradient checking for ops and models. The checked function
 * builds one tensor from its inputs; the scalar is L = sum(out * R) for a fixed
 * random R, evaluated in double from the f32 outputs. Analytic gradients come from
 * anneal_backward; numerical ones from central differences (x +/- eps) on every
 * element of every input that requires grad (views included: the perturbation goes
 * through the input's strides). A mismatch reports input, element and both values. */
#ifndef ANNEAL_TEST_GRADCHECK_H
#define ANNEAL_TEST_GRADCHECK_H

#include "anneal/anneal.h"

typedef anneal_tensor *(*anneal_gc_fn)(void *ctx, anneal_tensor *const *inputs);

/* True when |analytic - numeric| <= atol + rtol * |numeric| for every element.
 * Inputs that require grad must be f32 leaves. On failure, describes the worst
 * element in msg (and also records a harness failure via CHECK in the caller). */
bool anneal_gradcheck(anneal_gc_fn f, void *ctx, int n, anneal_tensor *const *inputs, double eps,
                      double atol, double rtol, char *msg, size_t msg_len);

/* f32 tensor of the shape with values uniform in [lo, hi) from a fixed seed, requires_grad as given. */
anneal_tensor *anneal_test_rand(int ndim, const int64_t *shape, float lo, float hi, uint64_t seed,
                                bool requires_grad);

/* Gives t a caller-owned contiguous gradient holding vals (numel of t floats), as the
 * autograd engine does, replacing any it had. */
void anneal_test_set_grad(anneal_tensor *t, const float *vals);

/* The worst |analytic - numeric| / (atol + rtol * |numeric|) of the last call over every
 * element (INFINITY when it failed): how much of its tolerance a check used. */
double anneal_gradcheck_last_ratio(void);
/* With ANNEAL_GRADCHECK_REPORT=1, prints that ratio for the call at file:line to stderr
 * (how the tolerances of the CHECK_GRAD calls were set: about 10x the worst measured). */
void anneal_gradcheck_report(const char *file, int line);

#define CHECK_GRAD(f, ctx, n, inputs, eps, atol, rtol) do { char _m[512]; \
    if (!anneal_gradcheck((f), (ctx), (n), (inputs), (eps), (atol), (rtol), _m, sizeof _m)) \
        anneal_test_fail(__FILE__, __LINE__, "gradcheck %s: %s", #f, _m); \
    anneal_gradcheck_report(__FILE__, __LINE__); } while (0)

#endif

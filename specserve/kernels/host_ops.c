/* The kernels of layer_ops.c that a speculative step calls between its forwards, as a CPython
 * extension module: they take the step's Python lists and give Python lists back.
 *
 * Between two forwards the code of everything a step runs is cold again, and a ctypes call
 * there costs its argument conversion, an array built from the lists and a slice read back: a
 * greedy verification of one request took ~17 us that way, of which its C ~5 us (the ctypes
 * call alone, for a walk of a few rows). Here each is one call that reads the lists in place
 * and builds its result directly.
 *
 * greedy_walk(x, rows, n, row_stride, roots, trees, threads) -> (paths, finals)
 *     greedy verification (layer_ops.c: greedy_walk) of every request's tree: x the address of
 *     `rows` rows of n float32 (row r at x + r * row_stride); roots: B ints; trees: B
 *     tuples whose first two items are its tokens and parents (int lists). paths: B lists of accepted node indices; finals: B
 *     ints. IndexError when a tree's rows run past x.
 * top_logprob_lists(x, rows, n, row_stride, k, d2t, threads) -> (values, ids)
 *     layer_ops.c: top_logprobs, flat [rows * k] lists row after row; d2t: the address of an
 *     [n] int64 map, or 0.
 * medusa_trees(x, heads, B, n, row_stride, width, d2t, plan, dfs, P, budgets, min_score, threads)
 *     -> B (tokens, parents, scores) tuples: layer_ops.c: medusa_trees (plan and dfs the
 *     addresses of its [P, 3] and [P] int64 arrays; budgets B ints).
 * The addresses and shapes come from the caller (specserve.kernels.layer_ops), which checked them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "layer_ops.c"

/* Appends the ints of a list (or tuple) to buf[*at..]; -1 with a Python error set. */
static int read_ints(PyObject *seq, int64_t *buf, Py_ssize_t *at) {
    PyObject *fast = PySequence_Fast(seq, "expected a list of ints");
    if (!fast) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        buf[(*at)++] = v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *int_list(const int64_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *float_list(const float *fv, const double *dv, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyFloat_FromDouble(fv ? (double)fv[i] : dv[i]);
        if (!x) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

/* The arguments as kinds says, one letter each: 'i' an int (read into out[i]), 'o' anything
 * (read by the caller); -1 with a Python error set. */
static int parse(PyObject *const *args, Py_ssize_t nargs, const char *kinds, int64_t *out, const char *name) {
    const Py_ssize_t want = (Py_ssize_t)strlen(kinds);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (kinds[i] != 'i') continue;
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *py_greedy_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    if (parse(args, nargs, "iiiiooi", a, "greedy_walk")) return NULL;
    PyObject *roots = args[4], *trees = PySequence_Fast(args[5], "greedy_walk: trees must be a list");
    if (!trees) return NULL;
    const Py_ssize_t B = PySequence_Fast_GET_SIZE(trees);
    PyObject **tree = PySequence_Fast_ITEMS(trees);
    Py_ssize_t M = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        PyObject *tokens = PyTuple_Check(tree[b]) && PyTuple_GET_SIZE(tree[b]) >= 2 ? PyTuple_GET_ITEM(tree[b], 0)
                                                                                     : NULL;
        const Py_ssize_t m = tokens ? PyObject_Length(tokens) : -1;
        if (m < 0) {
            Py_DECREF(trees);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "greedy_walk: trees are (tokens, parents) pairs");
            return NULL;
        }
        M += m;
    }
    int64_t *in = malloc((size_t)(2 * B + 1 + 2 * M + 1) * sizeof(int64_t));
    int64_t *out = malloc((size_t)(M + 2 * B + 1) * sizeof(int64_t));
    PyObject *result = NULL;
    if (!in || !out) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t at = 0, tok_at = 2 * B + 1, par_at = 2 * B + 1 + M;
    if (read_ints(roots, in, &at)) goto done;
    if (at != B) {
        PyErr_SetString(PyExc_ValueError, "greedy_walk: one root per tree");
        goto done;
    }
    in[at++] = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        const Py_ssize_t t0 = tok_at, p0 = par_at;
        if (read_ints(PyTuple_GET_ITEM(tree[b], 0), in, &tok_at) || read_ints(PyTuple_GET_ITEM(tree[b], 1), in, &par_at))
            goto done;
        if (tok_at - t0 != par_at - p0) {
            PyErr_SetString(PyExc_ValueError, "greedy_walk: a tree's tokens and parents differ in length");
            goto done;
        }
        in[at] = in[at - 1] + (tok_at - t0);
        at++;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = greedy_walk((const float *)(intptr_t)a[0], a[1], a[2], a[3], B, M, in, out, (int)a[6]);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_Format(PyExc_IndexError, "greedy_walk: a tree's rows run past the %lld rows of x", (long long)a[1]);
        goto done;
    }
    PyObject *paths = PyList_New(B), *finals = int_list(out + M + B, B);
    if (!paths || !finals) {
        Py_XDECREF(paths), Py_XDECREF(finals);
        goto done;
    }
    for (Py_ssize_t b = 0; b < B; b++) {
        PyObject *path = int_list(out + in[B + b], out[M + b]);
        if (!path) {
            Py_DECREF(paths), Py_DECREF(finals);
            goto done;
        }
        PyList_SET_ITEM(paths, b, path);
    }
    result = PyTuple_Pack(2, paths, finals);
    Py_DECREF(paths), Py_DECREF(finals);
done:
    free(in), free(out);
    Py_DECREF(trees);
    return result;
}

static PyObject *py_top_logprob_lists(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    if (parse(args, nargs, "iiiiiii", a, "top_logprob_lists")) return NULL;
    const int64_t rows = a[1], k = a[4];
    float *val = malloc((size_t)(rows * k + 1) * sizeof(float));
    int64_t *idx = malloc((size_t)(rows * k + 1) * sizeof(int64_t));
    PyObject *result = NULL;
    if (!val || !idx) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    top_logprobs((const float *)(intptr_t)a[0], rows, a[2], a[3], k, (const int64_t *)(intptr_t)a[5], val, idx,
                 (int)a[6]);
    Py_END_ALLOW_THREADS
    PyObject *v = float_list(val, NULL, rows * k), *i = int_list(idx, rows * k);
    if (v && i) result = PyTuple_Pack(2, v, i);
    Py_XDECREF(v), Py_XDECREF(i);
done:
    free(val), free(idx);
    return result;
}

static PyObject *py_medusa_trees(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[13];
    if (parse(args, nargs, "iiiiiiiiiiooi", a, "medusa_trees")) return NULL;
    const int64_t B = a[2], P = a[9];
    const double min_score = PyFloat_AsDouble(args[11]);
    if (min_score == -1.0 && PyErr_Occurred()) return NULL;
    int64_t *budget = malloc((size_t)(B + 1) * sizeof(int64_t));
    int64_t *out = malloc((size_t)(B * (2 * P + 1) + 1) * sizeof(int64_t));
    double *scores = malloc((size_t)(B * P + 1) * sizeof(double));
    PyObject *result = NULL;
    Py_ssize_t at = 0;
    if (!budget || !out || !scores) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_ints(args[10], budget, &at)) goto done;
    if (at != B) {
        PyErr_SetString(PyExc_ValueError, "medusa_trees: one budget per request");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = medusa_trees((const float *)(intptr_t)a[0], a[1], B, a[3], a[4], a[5], (const int64_t *)(intptr_t)a[6],
                      (const int64_t *)(intptr_t)a[7], (const int64_t *)(intptr_t)a[8], P, budget, min_score, out,
                      scores, (int)a[12]);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyList_New(B);
    if (!result) goto done;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *tok = out + b * (2 * P + 1), m = tok[2 * P];
        PyObject *t = int_list(tok, m), *p = int_list(tok + P, m), *s = float_list(NULL, scores + b * P, m);
        PyObject *tree = t && p && s ? PyTuple_Pack(3, t, p, s) : NULL;
        Py_XDECREF(t), Py_XDECREF(p), Py_XDECREF(s);
        if (!tree) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, tree);
    }
done:
    free(budget), free(out), free(scores);
    return result;
}

static PyMethodDef methods[] = {
    {"greedy_walk", (PyCFunction)(void (*)(void))py_greedy_walk, METH_FASTCALL, "greedy verification of every tree"},
    {"top_logprob_lists", (PyCFunction)(void (*)(void))py_top_logprob_lists, METH_FASTCALL, "top-k log-softmax as lists"},
    {"medusa_trees", (PyCFunction)(void (*)(void))py_medusa_trees, METH_FASTCALL, "Medusa's draft trees"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "host_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit_host_ops(void) { return PyModule_Create(&module); }

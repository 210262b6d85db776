/* Greedy verification (layer_ops.c: greedy_walk), what a speculative step calls between its
 * forwards on every device, as a CPython extension module: it takes the step's Python lists and
 * gives Python lists back.
 *
 * Between two forwards the code of everything a step runs is cold again, and a ctypes call
 * there costs its argument conversion, an array built from the lists and a slice read back: a
 * greedy verification of one request took ~17 us that way, of which its C ~5 us (the ctypes
 * call alone, for a walk of a few rows). Here it is one call that reads the lists in place
 * and builds its result directly. The speculative methods' tree growth (Medusa's trees, EAGLE's
 * passes) is built the same way, on these kernels, from specserve/spec_decode/tree_ops.c.
 *
 * greedy_walk(x, rows, n, row_stride, roots, trees, threads) -> (paths, finals)
 *     greedy verification (layer_ops.c: greedy_walk) of every request's tree: x the address of
 *     `rows` rows of n float32 (row r at x + r * row_stride); roots: B ints; trees: B
 *     tuples whose first two items are its tokens and parents (int lists). paths: B lists of accepted node indices; finals: B
 *     ints. IndexError when a tree's rows run past x.
 * The addresses and shapes come from the caller (specserve.kernels.cpu.layer_ops), which checked them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "layer_ops.c"
#include "pylists.h"

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

static PyMethodDef methods[] = {
    {"greedy_walk", (PyCFunction)(void (*)(void))py_greedy_walk, METH_FASTCALL, "greedy verification of every tree"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "host_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit_host_ops(void) { return PyModule_Create(&module); }

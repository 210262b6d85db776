/* Python lists read and built in C: what the extension modules on the CPU's kernels share
 * (host_ops.c here, specserve/spec_decode/tree_ops.c, whose build puts this folder on its include
 * path). <Python.h> comes first, as in those sources. */
#ifndef SPECSERVE_PYLISTS_H
#define SPECSERVE_PYLISTS_H

#include <stdint.h>
#include <string.h>

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

#endif

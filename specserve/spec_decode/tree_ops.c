/* EAGLE's and Medusa's tree growth (the host side of specserve.spec_decode.eagle and .medusa) as
 * a CPython extension module on the CPU's kernels: layer_ops.c's top_logprobs and pylists.h, from
 * specserve/kernels/cpu, which its build (cbuild.Extension) puts on the include path. As
 * host_ops.c there, each call reads the step's Python lists in place and builds its result
 * directly: between two forwards a ctypes call would spend more on converting them than the C on
 * its work.
 *
 * medusa_trees(x, heads, B, n, row_stride, width, d2t, ids, plan, dfs, P, budgets, min_score, threads)
 *     -> B (tokens, parents, scores) tuples: Medusa's draft trees for a batch from its heads'
 *     top-k (medusa_trees below: which rank paths pass the budget and the score cut, listed
 *     depth first), one call where Python takes two loops over the paths of every request
 *     (d2t: the address of an [n] int64 map, or 0; ids: 0, or the address of the top-k's ids
 *     when x holds the top-k already; plan and dfs the addresses of its [P, 3] and [P] int64
 *     arrays; budgets B ints).
 * eagle_children(x, rows, n, row_stride, k, d2t, ids, threads, min_score, grow, parents) -> None
 *     EAGLE's children of one pass, appended to each growing tree's lists, and its next
 *     frontier (below); d2t and ids as for medusa_trees.
 * eagle_next_pass(grow, depth) -> (active, index, segments) or None: the inputs of EAGLE's
 *     next head pass (below).
 * The addresses and shapes come from the caller (specserve.spec_decode.tree_ops), which checked them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "layer_ops.c"
#include "pylists.h"

/* A list of the n floats of fv (or, fv NULL, of the doubles of dv); NULL with a Python error set. */
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

/* top_logprobs, or, where ids is not NULL, the top-k taken already (on a GPU): x then holds rows of
 * k log q (row r at x + r * row_stride) and ids [rows, k] contiguous their tokens (d2t unused). */
static void top_or_given(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t k,
                         const int64_t *d2t, const int64_t *ids, float *val, int64_t *idx, int threads) {
    if (!ids) {
        top_logprobs(x, rows, n, row_stride, k, d2t, val, idx, threads);
        return;
    }
    for (int64_t r = 0; r < rows; r++) memcpy(val + r * k, x + r * row_stride, (size_t)k * sizeof(float));
    memcpy(idx, ids, (size_t)(rows * k) * sizeof(int64_t));
}

/* Medusa's trees. x: [K * B] rows of n logits (row k * B + b: head k, request b; row r at x + r
 * * row_stride); each head's w best per request (as top_logprobs: log q, the lower index first
 * on ties), their tokens through d2t (when not NULL); or, with ids, x's rows the heads' top w
 * already (top_or_given); plan: [P, 3] rank paths shorter first,
 * each (head, rank, index of its prefix path or -1); dfs: [P] path indices in depth-first
 * order; budget: [B]. For request b, path i is taken when its prefix was, its score (the
 * prefix's, 0 at the root, + its log q, in double as Python adds) is >= min_score, and fewer
 * than budget[b] paths were taken before it. The taken paths, depth first, are nodes 0..count-1
 * of request b: out[b] = (token [P], parent node [P] (-1: the root), count), scores[b] [P].
 * Returns 0, or -1 when out of memory (nothing written). */
int medusa_trees(const float *x, int64_t K, int64_t B, int64_t n, int64_t row_stride, int64_t w,
                 const int64_t *d2t, const int64_t *ids, const int64_t *plan, const int64_t *dfs, int64_t P, const int64_t *budget,
                 double min_score, int64_t *out, double *scores, int threads) {
    float *top_lp = malloc((size_t)(K * B * w) * sizeof(float));
    int64_t *top = malloc((size_t)(K * B * w) * sizeof(int64_t));
    double *score = malloc((size_t)P * sizeof(double));
    int64_t *node = malloc((size_t)P * sizeof(int64_t));
    if (!top_lp || !top || !score || !node) {
        free(top_lp), free(top), free(score), free(node);
        return -1;
    }
    top_or_given(x, K * B, n, row_stride, w, d2t, ids, top_lp, top, threads);
    for (int64_t b = 0; b < B; b++) {
        int64_t left = budget[b];
        for (int64_t i = 0; i < P; i++) {
            const int64_t head = plan[3 * i], rank = plan[3 * i + 1], prefix = plan[3 * i + 2];
            node[i] = -2; /* not taken */
            if (!left || (prefix >= 0 && node[prefix] == -2)) continue;
            const double s = (prefix >= 0 ? score[prefix] : 0.0) + (double)top_lp[(head * B + b) * w + rank];
            if (s < min_score) continue;
            score[i] = s, node[i] = -1, left--;
        }
        int64_t *tok = out + b * (2 * P + 1), *par = tok + P, m = 0;
        for (int64_t j = 0; j < P; j++) {
            const int64_t i = dfs[j];
            if (node[i] == -2) continue;
            const int64_t head = plan[3 * i], rank = plan[3 * i + 1], prefix = plan[3 * i + 2];
            node[i] = m;
            tok[m] = top[(head * B + b) * w + rank];
            par[m] = prefix >= 0 ? node[prefix] : -1;
            scores[b * P + m] = score[i];
            m++;
        }
        tok[2 * P] = m;
    }
    free(top_lp), free(top), free(score), free(node);
    return 0;
}

static PyObject *py_medusa_trees(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[14];
    if (parse(args, nargs, "iiiiiiiiiiiooi", a, "medusa_trees")) return NULL;
    const int64_t B = a[2], P = a[10];
    const double min_score = PyFloat_AsDouble(args[12]);
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
    if (read_ints(args[11], budget, &at)) goto done;
    if (at != B) {
        PyErr_SetString(PyExc_ValueError, "medusa_trees: one budget per request");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = medusa_trees((const float *)(intptr_t)a[0], a[1], B, a[3], a[4], a[5], (const int64_t *)(intptr_t)a[6],
                      (const int64_t *)(intptr_t)a[7], (const int64_t *)(intptr_t)a[8], (const int64_t *)(intptr_t)a[9],
                      P, budget, min_score, out, scores, (int)a[13]);
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

/* One pass's children for EAGLE's growing trees (specserve.spec_decode.eagle: _add_children):
 * row r of x is the draft's logits after the r-th parent, parents listed request after request
 * (or their top-k given: top_or_given); each parent gets its k best tokens (through d2t) as
 * children scoring the parent's score (0 at the root, -1) + log q. Each request's lists
 * (tokens, scores, parents, out_row, rows: attributes of grow[b]) get them appended, and
 * grow[b].frontier becomes its k best new nodes (a stable sort by score, descending, as
 * Python's) that score >= min_score. */
static PyObject *s_tokens, *s_scores, *s_parents, *s_out_row, *s_rows, *s_frontier;

static PyObject *py_eagle_children(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[11];
    if (parse(args, nargs, "iiiiiiiiooo", a, "eagle_children")) return NULL;
    const double min_score = PyFloat_AsDouble(args[8]);
    if (min_score == -1.0 && PyErr_Occurred()) return NULL;
    const int64_t rows = a[1], k = a[4];
    PyObject *grow = PySequence_Fast(args[9], "eagle_children: grow must be a list");
    if (!grow) return NULL;
    PyObject *parents = PySequence_Fast(args[10], "eagle_children: parents must be a list");
    float *val = malloc((size_t)(rows * k + 1) * sizeof(float));
    int64_t *idx = malloc((size_t)(rows * k + 1) * sizeof(int64_t));
    int64_t *best = malloc((size_t)(k + 1) * sizeof(int64_t));
    PyObject *result = NULL, *minus_one = PyLong_FromLong(-1);
    if (!parents || !val || !idx || !best || !minus_one) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    const Py_ssize_t B = PySequence_Fast_GET_SIZE(grow);
    if (PySequence_Fast_GET_SIZE(parents) != B) {
        PyErr_SetString(PyExc_ValueError, "eagle_children: one parent list per request");
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        const Py_ssize_t m = PyObject_Length(PySequence_Fast_ITEMS(parents)[b]);
        if (m < 0) goto done;
        total += m;
    }
    if (total != rows) {
        PyErr_Format(PyExc_ValueError, "eagle_children: %zd parents for %lld rows", total, (long long)rows);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    top_or_given((const float *)(intptr_t)a[0], rows, a[2], a[3], k, (const int64_t *)(intptr_t)a[5],
                 (const int64_t *)(intptr_t)a[6], val, idx, (int)a[7]);
    Py_END_ALLOW_THREADS
    Py_ssize_t at = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        PyObject *g = PySequence_Fast_ITEMS(grow)[b];
        PyObject *tokens = PyObject_GetAttr(g, s_tokens), *scores = PyObject_GetAttr(g, s_scores);
        PyObject *par = PyObject_GetAttr(g, s_parents), *out_row = PyObject_GetAttr(g, s_out_row);
        PyObject *grows = PyObject_GetAttr(g, s_rows);
        PyObject *ps = PySequence_Fast(PySequence_Fast_ITEMS(parents)[b], "eagle_children: parents are lists");
        PyObject *frontier = NULL;
        int ok = tokens && scores && par && out_row && grows && ps && PyList_Check(tokens) && PyList_Check(scores)
                 && PyList_Check(par) && PyList_Check(out_row) && PyList_Check(grows);
        if (ok) {
            const Py_ssize_t start = PyList_GET_SIZE(tokens), np = PySequence_Fast_GET_SIZE(ps);
            for (Py_ssize_t j = 0; ok && j < np; j++, at++) {
                PyObject *p = PySequence_Fast_ITEMS(ps)[j];
                const long long pi = PyLong_AsLongLong(p);
                double base = 0.0;
                if (pi == -1 && PyErr_Occurred()) ok = 0;
                else if (pi >= 0) {
                    if (pi >= PyList_GET_SIZE(scores)) {
                        PyErr_SetString(PyExc_IndexError, "eagle_children: a parent past the tree");
                        ok = 0;
                    } else {
                        base = PyFloat_AsDouble(PyList_GET_ITEM(scores, pi));
                        if (base == -1.0 && PyErr_Occurred()) ok = 0;
                    }
                }
                for (int64_t c = 0; ok && c < k; c++) {
                    PyObject *t = PyLong_FromLongLong(idx[at * k + c]), *sc = PyFloat_FromDouble(base + (double)val[at * k + c]);
                    ok = t && sc && !PyList_Append(tokens, t) && !PyList_Append(scores, sc) && !PyList_Append(par, p)
                         && !PyList_Append(out_row, minus_one) && !PyList_Append(grows, minus_one);
                    Py_XDECREF(t), Py_XDECREF(sc);
                }
            }
            /* the k best new nodes, ties in order (a stable sort, descending), then the score cut */
            const Py_ssize_t end = PyList_GET_SIZE(scores);
            int64_t nb = 0;
            for (Py_ssize_t i = start; ok && i < end; i++) {
                const double v = PyFloat_AS_DOUBLE(PyList_GET_ITEM(scores, i));
                int64_t pos = nb;
                while (pos > 0 && PyFloat_AS_DOUBLE(PyList_GET_ITEM(scores, best[pos - 1])) < v) pos--;
                if (pos >= k) continue;
                for (int64_t q = (nb < k ? nb : k - 1); q > pos; q--) best[q] = best[q - 1];
                best[pos] = i;
                if (nb < k) nb++;
            }
            if (ok) ok = (frontier = PyList_New(0)) != NULL;
            for (int64_t q = 0; ok && q < nb; q++) {
                if (!(PyFloat_AS_DOUBLE(PyList_GET_ITEM(scores, best[q])) >= min_score)) continue;
                PyObject *i = PyLong_FromLongLong(best[q]);
                ok = i && !PyList_Append(frontier, i);
                Py_XDECREF(i);
            }
            if (ok) ok = !PyObject_SetAttr(g, s_frontier, frontier);
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "eagle_children: a tree's tokens, scores, parents, out_row and rows "
                                             "must be lists");
        }
        Py_XDECREF(tokens), Py_XDECREF(scores), Py_XDECREF(par), Py_XDECREF(out_row), Py_XDECREF(grows);
        Py_XDECREF(ps), Py_XDECREF(frontier);
        if (!ok) goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    free(val), free(idx), free(best);
    Py_XDECREF(minus_one), Py_XDECREF(parents);
    Py_DECREF(grow);
    return result;
}

/* The rows of EAGLE's next pass (specserve.spec_decode.eagle: _grow): each growing tree
 * grow[b] with a frontier runs it through the head, its KV entries from cache.pairs + expanded
 * on. Per frontier node i (j-th): its row sees the committed pairs, its expanded ancestors and
 * itself (mask), its KV entry rows[i] = expanded + j, its output row out_row[i]; its input is
 * its token at position `position + depth - 1` and its parent's output row (the root's: b).
 * Returns (the b of each tree in the pass, a bytearray of [3, N] int64: token ids, positions,
 * parents' rows, and per tree (a bytearray of its mask [f, past + f] bool, past, f)), each
 * tree's expanded advanced by f;
 * None when no tree has a frontier. */
static PyObject *s_expanded, *s_position, *s_cache, *s_pairs;

static int64_t int_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    const long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return x;
}

static PyObject *py_eagle_next_pass(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[2];
    if (parse(args, nargs, "oi", a, "eagle_next_pass")) return NULL;
    const int64_t depth = a[1];
    PyObject *grow = PySequence_Fast(args[0], "eagle_next_pass: grow must be a list");
    if (!grow) return NULL;
    const Py_ssize_t B = PySequence_Fast_GET_SIZE(grow);
    PyObject *active = PyList_New(0), *segments = PyList_New(0), *result = NULL;
    int64_t *index = NULL;
    Py_ssize_t N = 0, cap = 0; /* rows so far; rows in all (index: [3, cap]) */
    if (!active || !segments) goto done;
    for (Py_ssize_t b = 0; b < B; b++) {
        PyObject *frontier = PyObject_GetAttr(PySequence_Fast_ITEMS(grow)[b], s_frontier);
        const Py_ssize_t f = frontier ? PyObject_Length(frontier) : -1;
        Py_XDECREF(frontier);
        if (f < 0) goto done;
        cap += f;
    }
    if (!(index = malloc((size_t)(3 * cap + 1) * sizeof(int64_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < B; b++) {
        PyObject *g = PySequence_Fast_ITEMS(grow)[b];
        PyObject *frontier = PyObject_GetAttr(g, s_frontier), *tokens = PyObject_GetAttr(g, s_tokens);
        PyObject *par = PyObject_GetAttr(g, s_parents), *out_row = PyObject_GetAttr(g, s_out_row);
        PyObject *grows = PyObject_GetAttr(g, s_rows), *cache = PyObject_GetAttr(g, s_cache), *mask = NULL;
        int ok = frontier && tokens && par && out_row && grows && cache && PyList_Check(frontier) && PyList_Check(tokens)
                 && PyList_Check(par) && PyList_Check(out_row) && PyList_Check(grows);
        if (!ok && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "eagle_next_pass: a tree's lists must be lists");
        const Py_ssize_t f = ok ? PyList_GET_SIZE(frontier) : 0, size = ok ? PyList_GET_SIZE(tokens) : 0;
        if (ok && f) {
            const int64_t past = int_attr(cache, s_pairs), num = int_attr(g, s_expanded);
            const int64_t position = int_attr(g, s_position) + depth - 1;
            ok = !PyErr_Occurred() && past >= 0 && num >= 0;
            const int64_t width = past + num + f;
            if (ok && N + f > cap) {
                PyErr_SetString(PyExc_RuntimeError, "eagle_next_pass: a frontier changed while read");
                ok = 0;
            }
            if (ok) ok = (mask = PyByteArray_FromStringAndSize(NULL, f * width)) != NULL;
            if (ok) {
                char *m = PyByteArray_AS_STRING(mask);
                memset(m, 0, (size_t)(f * width));
                for (Py_ssize_t j = 0; ok && j < f; j++) {
                    char *row = m + j * width;
                    memset(row, 1, (size_t)past);
                    row[past + num + j] = 1;
                    const long long i = PyLong_AsLongLong(PyList_GET_ITEM(frontier, j));
                    if (i < 0 || i >= size) {
                        if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "eagle_next_pass: a node past the tree");
                        ok = 0;
                        break;
                    }
                    long long node = i, parent = PyLong_AsLongLong(PyList_GET_ITEM(par, i));
                    for (Py_ssize_t hops = 0; ok && (node = PyLong_AsLongLong(PyList_GET_ITEM(par, node))) >= 0; hops++) {
                        const long long r = node < size ? PyLong_AsLongLong(PyList_GET_ITEM(grows, node)) : -1;
                        if (r < 0 || r >= num || hops >= size) {
                            PyErr_SetString(PyExc_ValueError, "eagle_next_pass: an ancestor not run");
                            ok = 0;
                        } else row[past + r] = 1;
                    }
                    if (!ok) break;
                    PyObject *r = PyLong_FromLongLong(num + j), *o = PyLong_FromSsize_t(N);
                    ok = r && o && !PyList_SetItem(grows, i, r) && !PyList_SetItem(out_row, i, o);
                    if (!ok) break;
                    const long long src = parent >= 0 ? PyLong_AsLongLong(PyList_GET_ITEM(out_row, parent)) : b;
                    index[N] = PyLong_AsLongLong(PyList_GET_ITEM(tokens, i));
                    index[cap + N] = position;
                    index[2 * cap + N] = src;
                    N++;
                }
            }
            if (ok) {
                PyObject *e = PyLong_FromLongLong(num + f), *bb = PyLong_FromSsize_t(b);
                PyObject *seg = mask ? Py_BuildValue("(OLn)", mask, (long long)(past + num), f) : NULL;
                ok = e && bb && seg && !PyObject_SetAttr(g, s_expanded, e) && !PyList_Append(active, bb)
                     && !PyList_Append(segments, seg);
                Py_XDECREF(e), Py_XDECREF(bb), Py_XDECREF(seg);
            }
        }
        Py_XDECREF(frontier), Py_XDECREF(tokens), Py_XDECREF(par), Py_XDECREF(out_row), Py_XDECREF(grows);
        Py_XDECREF(cache), Py_XDECREF(mask);
        if (!ok || PyErr_Occurred()) goto done;
    }
    if (!N) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    PyObject *flat = PyByteArray_FromStringAndSize(NULL, 3 * N * (Py_ssize_t)sizeof(int64_t));
    if (!flat) goto done;
    for (int64_t r = 0; r < 3; r++)
        memcpy(PyByteArray_AS_STRING(flat) + r * N * sizeof(int64_t), index + r * cap, N * sizeof(int64_t));
    result = PyTuple_Pack(3, active, flat, segments);
    Py_DECREF(flat);
done:
    free(index);
    Py_XDECREF(active), Py_XDECREF(segments);
    Py_DECREF(grow);
    return result;
}

static PyMethodDef methods[] = {
    {"medusa_trees", (PyCFunction)(void (*)(void))py_medusa_trees, METH_FASTCALL, "Medusa's draft trees"},
    {"eagle_children", (PyCFunction)(void (*)(void))py_eagle_children, METH_FASTCALL, "EAGLE's children of a pass"},
    {"eagle_next_pass", (PyCFunction)(void (*)(void))py_eagle_next_pass, METH_FASTCALL, "EAGLE's next pass's rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tree_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tree_ops(void) {
    if (!(s_tokens = PyUnicode_InternFromString("tokens")) || !(s_scores = PyUnicode_InternFromString("scores"))
        || !(s_parents = PyUnicode_InternFromString("parents")) || !(s_out_row = PyUnicode_InternFromString("out_row"))
        || !(s_rows = PyUnicode_InternFromString("rows")) || !(s_frontier = PyUnicode_InternFromString("frontier"))
        || !(s_expanded = PyUnicode_InternFromString("expanded")) || !(s_position = PyUnicode_InternFromString("position"))
        || !(s_cache = PyUnicode_InternFromString("cache")) || !(s_pairs = PyUnicode_InternFromString("pairs")))
        return NULL;
    return PyModule_Create(&module);
}

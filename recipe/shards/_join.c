/* The byte planes of 16-bit words joined back into words: out[i] = high[i] << 8 | low[i].
 *
 * The reader's one loop numpy cannot do in a single pass: numpy's formulation (a casting shift, then
 * an or) walks the output twice through its cast buffers, ~2.5 GB/s of words on one core, where this
 * loop is one vectorised pass at memory speed (docs/benchmarks.md, section 0000). Optional: the
 * reader falls back to numpy when this module was not built (recipe/shards/codec.py).
 * Limited API (abi3): one build serves every CPython >= 3.11. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static void join_words(const uint8_t *restrict high, const uint8_t *restrict low, uint16_t *restrict out,
                       Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)  /* the same words as numpy's from_planes: native uint16 */
        out[i] = (uint16_t)(high[i] << 8 | low[i]);
}

static PyObject *join(PyObject *self, PyObject *args) {
    Py_buffer high, low, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*:join", &high, &low, &out))
        return NULL;
    PyObject *result = NULL;
    if (high.len != low.len || out.len != 2 * high.len)
        PyErr_Format(PyExc_ValueError, "join: %zd high bytes, %zd low bytes, %zd output bytes (want n, n, 2n)",
                     high.len, low.len, out.len);
    else {
        Py_BEGIN_ALLOW_THREADS  /* DataLoader threads decode side by side */
        join_words(high.buf, low.buf, out.buf, high.len);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&high);
    PyBuffer_Release(&low);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"join", join, METH_VARARGS, "join(high, low, out): out's 16-bit words (native order) = high << 8 | low."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_join", NULL, 0, methods};

PyMODINIT_FUNC PyInit__join(void) { return PyModule_Create(&module); }

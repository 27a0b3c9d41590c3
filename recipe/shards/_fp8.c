/* The fp8 codec's two loops (recipe/shards/fp8.py).
 *
 * quantize: rows of bf16 words, given as their byte planes (the packer's layout), each row one token's
 *   state in one slot: scale = max|x| / 448, code = e4m3fn(x * 448 / max|x|) rounded to nearest even,
 *   stored split: the 4 exponent bits of two codes in one byte (exp), their sign and 3 mantissa bits
 *   in another (sm), value i of a row with value i + width/2; per row also the squared error of what
 *   dequantize gives back and x's squared norm.
 * dequantize: bf16 words (rounded to nearest even) = e4m3fn(code) * scale, from exp and sm.
 * Why split: zstd's Huffman decoding is the reader's cost, per symbol. The exponents carry the code's
 * redundancy (2.9 of 4 bits on real activations); sign and mantissa are noise (4.0 of 4). Two exponents
 * a byte halve the symbols zstd decodes, and the noise bytes pass through raw (bench/fp8.py).
 * Optional: fp8.py does the same in numpy where this module was not built; the tests hold the two, and
 * torch's own float8_e4m3fn conversion, to the same bytes. Limited API (abi3). */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FP8_MAX 448.0f

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* |f| <= 448 (clamped by the caller), finite: its e4m3fn code, rounded to nearest, ties to even.
 * Branch-free, so the loops vectorise. Normal (|f| >= 2^-6): float32's exponent and top 3 mantissa bits,
 * rounded to nearest even by one add, rebiased from 127 to 7. Subnormal: multiples of 2^-9, rounded by
 * adding 2^23 (where a float's unit is 1); 8 of them make the smallest normal, whose code is 8. */
static inline uint8_t encode(float f) {
    uint32_t u = to_bits(f), a = u & 0x7FFFFFFFu;
    uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t sub = to_bits(from_bits(a) * 512.0f + 8388608.0f) - 0x4B000000u;
    uint32_t small = 0u - (uint32_t)(a < 0x3C800000u);  /* all ones below 2^-6 */
    uint32_t code = (sub & small) | (normal & ~small);
    code = code < 0x7Eu ? code : 0x7Eu;  /* saturate: a hair over 448 rounds to 448 */
    return (uint8_t)(((u >> 24) & 0x80u) | code);
}

/* An e4m3fn code's value (finite codes): the inverse of encode, branch-free. */
static inline float decode(uint8_t c) {
    uint32_t m = c & 0x7Fu, normal = (m << 20) + (120u << 23), sub = to_bits((float)m * (1.0f / 512.0f));
    uint32_t big = 0u - (uint32_t)(m >= 8u);
    return from_bits((normal & big) | (sub & ~big) | ((uint32_t)(c & 0x80u) << 24));
}

static inline uint16_t to_bf16(float v) {
    uint32_t b = to_bits(v);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline float bf16_value(const uint8_t *h, const uint8_t *l, Py_ssize_t i) {
    return from_bits((uint32_t)(h[i] << 8 | l[i]) << 16);
}

/* One build that uses AVX2 where the CPU has it (gcc picks the clone at load time), SSE2 elsewhere. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

WIDE static void quantize_rows(const uint8_t *hi, const uint8_t *lo, Py_ssize_t rows, Py_ssize_t width, uint8_t *exp,
                               uint8_t *sm, float *scales, double *err, double *norm, uint8_t *restrict codes,
                               float *restrict d2, float *restrict f2) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint8_t *h = hi + r * width, *l = lo + r * width;
        uint32_t top = 0;  /* max |x|: finite floats order as their magnitude bits do */
        for (Py_ssize_t i = 0; i < width; i++) {
            uint32_t m = (uint32_t)((h[i] & 0x7F) << 8 | l[i]);
            top = m > top ? m : top;
        }
        float amax = from_bits(top << 16), scale = amax / FP8_MAX, inv = amax > 0.0f ? FP8_MAX / amax : 0.0f;
        /* sums in the scale's units (each term at most 448^2, a float holds them), back in x's units in
           double: what underflows here is below 1e-38 of the row's squared norm, nothing to its error */
        /* two passes: a sum carried through the coding loop kept it from vectorising (a float sum is
           not reordered): 0.29 against 1.2 GB/s a core (bench/fp8.py). The squares go to d2 and f2,
           then eight partial sums, one a lane */
        for (Py_ssize_t i = 0; i < width; i++) {
            float x = bf16_value(h, l, i), f = x * inv;
            uint8_t c = encode(f);
            codes[i] = c;
            float d = (from_bits((uint32_t)to_bf16(decode(c) * scale) << 16) - x) * inv;
            d2[i] = d * d;
            f2[i] = f * f;
        }
        float e2v[8] = {0}, n2v[8] = {0}, e2 = 0.0f, n2 = 0.0f;
        Py_ssize_t i = 0;
        for (; i + 8 <= width; i += 8)
            for (int k = 0; k < 8; k++) {
                e2v[k] += d2[i + k];
                n2v[k] += f2[i + k];
            }
        for (; i < width; i++) {
            e2 += d2[i];
            n2 += f2[i];
        }
        for (int k = 0; k < 8; k++) {
            e2 += e2v[k];
            n2 += n2v[k];
        }
        Py_ssize_t half = width / 2;
        uint8_t *e = exp + r * half, *s = sm + r * half;
        for (Py_ssize_t i = 0; i < half; i++) {  /* then split: value i and value i + half share a byte */
            uint8_t c0 = codes[i], c1 = codes[i + half];
            e[i] = (uint8_t)((c0 & 0x78) << 1 | (c1 & 0x78) >> 3);
            s[i] = (uint8_t)((((c0 >> 4) & 8) | (c0 & 7)) << 4 | ((c1 >> 4) & 8) | (c1 & 7));
        }
        scales[r] = scale;
        err[r] = (double)e2 * scale * scale;
        norm[r] = (double)n2 * scale * scale;
    }
}

/* A value from its exponent nibble and its sign-and-mantissa nibble, branch-free: what decode gives. A
 * subnormal (e = 0) is built as the normal 2^-6 * (1 + m/8), less 2^-6: exactly m * 2^-9. */
static inline float nibbles(uint32_t e, uint32_t sm) {
    uint32_t zero = 0u - (uint32_t)(e == 0u), m = sm & 7u;
    float v = from_bits(((e | (zero & 1u)) + 120u) << 23 | m << 20) - from_bits(zero & 0x3C800000u);
    return from_bits(to_bits(v) | (sm & 8u) << 28);
}

WIDE static void dequantize_rows(const uint8_t *exp, const uint8_t *sm, const float *scales, Py_ssize_t rows,
                                 Py_ssize_t width, uint16_t *out) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t half = width / 2;
        const uint8_t *e = exp + r * half, *s = sm + r * half;
        uint16_t *o = out + r * width;
        float scale = scales[r];
        for (Py_ssize_t i = 0; i < half; i++)
            o[i] = to_bf16(nibbles(e[i] >> 4, s[i] >> 4) * scale);
        for (Py_ssize_t i = 0; i < half; i++)
            o[i + half] = to_bf16(nibbles(e[i] & 15u, s[i] & 15u) * scale);
    }
}

static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_buffer hi, lo, exp, sm, scales, err, norm;
    Py_ssize_t width;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nw*w*w*w*w*:quantize", &hi, &lo, &width, &exp, &sm, &scales, &err, &norm))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = width > 0 ? hi.len / width : 0;
    if (width <= 0 || width % 2 || hi.len != rows * width || lo.len != hi.len || 2 * exp.len != hi.len ||
        sm.len != exp.len || scales.len != rows * 4 || err.len != rows * 8 || norm.len != rows * 8)
        PyErr_Format(PyExc_ValueError, "quantize: %zd bytes a plane in rows of %zd, buffers of other sizes", hi.len,
                     width);
    else {
        /* one row's squared errors and values before they are summed, and its codes before they are split */
        float *row = malloc((size_t)width * (2 * sizeof(float) + 1));
        if (row == NULL)
            PyErr_NoMemory();
        else {
            Py_BEGIN_ALLOW_THREADS
            quantize_rows(hi.buf, lo.buf, rows, width, exp.buf, sm.buf, scales.buf, err.buf, norm.buf,
                          (uint8_t *)(row + 2 * width), row, row + width);
            Py_END_ALLOW_THREADS
            free(row);
            result = Py_NewRef(Py_None);
        }
    }
    Py_buffer *all[] = {&hi, &lo, &exp, &sm, &scales, &err, &norm};
    for (int k = 0; k < 7; k++) PyBuffer_Release(all[k]);
    return result;
}

static PyObject *dequantize(PyObject *self, PyObject *args) {
    Py_buffer exp, sm, scales, out;
    Py_ssize_t width;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*nw*:dequantize", &exp, &sm, &scales, &width, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t rows = width > 0 ? 2 * exp.len / width : 0;
    if (width <= 0 || width % 2 || 2 * exp.len != rows * width || sm.len != exp.len || scales.len != rows * 4 ||
        out.len != 4 * exp.len)
        PyErr_Format(PyExc_ValueError, "dequantize: %zd exponent bytes in rows of %zd, buffers of other sizes",
                     exp.len, width);
    else {
        Py_BEGIN_ALLOW_THREADS  /* DataLoader threads decode side by side */
        dequantize_rows(exp.buf, sm.buf, scales.buf, rows, width, out.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&exp);
    PyBuffer_Release(&sm);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(hi, lo, width, exp, sm, scales, err, norm): bf16 planes -> split e4m3fn codes, f32 scales, sums"},
    {"dequantize", dequantize, METH_VARARGS, "dequantize(exp, sm, scales, width, out): e4m3fn * scale -> bf16"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fp8", NULL, 0, methods};

PyMODINIT_FUNC PyInit__fp8(void) { return PyModule_Create(&module); }

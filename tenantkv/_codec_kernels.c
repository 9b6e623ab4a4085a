/*
 * The CPU decoders of the lossy latent codecs (tenantkv.codecs), one pass from the opened codes
 * straight into the load's destination rows.
 *
 * Why C: decoding with torch operations takes several passes over memory per component (codes
 * widened to int32 or float32, looked up or converted, scaled, rounded to the model's dtype into
 * a temporary, then copied into the destination), and on a 2-core host that made a warm fp8 load
 * 5 times slower than reading twice the bytes under codec "none" (docs/perf.md, "Latent
 * codecs"). Here every output value is written once, from codes that stay in cache.
 *
 * Both functions release the GIL while they run, so the loader's workers decode in parallel.
 * Every offset is checked against the buffers' sizes before any byte is written: a wrong
 * argument raises ValueError and writes nothing. The results equal tenantkv.codecs' torch path
 * (which CUDA tensors and installs without a C compiler use): bit for bit for fp8 (the same
 * float32 product, rounded to nearest even once); for int4 within one rounding of the output
 * dtype (tests/test_codec_kernels.py).
 *
 * Portable C99 with no target flags: the loops are simple enough for any compiler at -O3.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The largest value an offset, stride or count may take: far above any buffer's size, and low
 * enough that the products below cannot overflow a long long. */
#define LIMIT ((long long)1 << 40)

/* The destination's element kinds (tenantkv.codecs passes these numbers). */
enum { OUT_BF16 = 0, OUT_F16 = 1, OUT_F32 = 2 };

static int in_range(long long value, const char *name) {
    if (value < 0 || value >= LIMIT) {
        PyErr_Format(PyExc_ValueError, "%s out of range", name);
        return 0;
    }
    return 1;
}

/* Whether bytes [start, start + length) lie within a buffer of ``size`` bytes. */
static int fits(long long start, long long length, Py_ssize_t size) {
    return start >= 0 && length >= 0 && start + length <= (long long)size;
}

/* The layout of one decode call, read from the Python arguments and checked. */
typedef struct {
    Py_buffer codes, dst, rows;
    long long codes_offset, codes_stride, dst_offset, dst_stride, tokens, width, itemsize;
    long long segments;
    const int64_t *row_starts;
} Call;

static void release(Call *call) {
    PyBuffer_Release(&call->codes);
    PyBuffer_Release(&call->dst);
    PyBuffer_Release(&call->rows);
}

/* Check that each segment's ``codes_bytes`` codes and its destination rows lie within their
 * buffers; 0 with ValueError set when one does not. */
static int check_call(Call *call, long long codes_bytes) {
    const char *names[] = {"codes_offset", "codes_stride", "dst_offset", "dst_stride", "tokens",
                           "width"};
    long long values[] = {call->codes_offset, call->codes_stride, call->dst_offset,
                          call->dst_stride,   call->tokens,       call->width};
    for (int i = 0; i < 6; i++) {
        if (!in_range(values[i], names[i])) {
            return 0;
        }
    }
    if (call->rows.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "row_starts must be int64");
        return 0;
    }
    call->segments = call->rows.len / 8;
    call->row_starts = (const int64_t *)call->rows.buf;
    if (call->segments == 0) {
        return 1;
    }
    if (call->tokens == 0 || call->width == 0) {
        PyErr_SetString(PyExc_ValueError, "tokens and width must be positive");
        return 0;
    }
    /* Products are formed only once a division shows they stay within a buffer's size, so
     * none can overflow. */
    if (call->tokens > ((long long)1 << 31) || call->width > ((long long)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "tokens or width out of range");
        return 0;
    }
    if (call->codes_stride > 0 && call->segments - 1 > call->codes.len / call->codes_stride) {
        PyErr_SetString(PyExc_ValueError, "the codes lie past the end of their buffer");
        return 0;
    }
    long long last = call->codes_offset + (call->segments - 1) * call->codes_stride;
    if (!fits(call->codes_offset, codes_bytes, call->codes.len) ||
        !fits(last, codes_bytes, call->codes.len)) {
        PyErr_SetString(PyExc_ValueError, "the codes lie past the end of their buffer");
        return 0;
    }
    long long row_bytes = call->width * call->itemsize;
    if (row_bytes > call->dst_stride) {
        PyErr_SetString(PyExc_ValueError, "a row's values are wider than the row stride");
        return 0;
    }
    if (call->tokens - 1 > call->dst.len / call->dst_stride) {
        PyErr_SetString(PyExc_ValueError, "the destination rows lie past its end");
        return 0;
    }
    for (long long s = 0; s < call->segments; s++) {
        long long row = call->row_starts[s];
        if (!in_range(row, "a row start") || row > call->dst.len / call->dst_stride) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "the destination rows lie past its end");
            }
            return 0;
        }
        long long first = call->dst_offset + row * call->dst_stride;
        long long span = (call->tokens - 1) * call->dst_stride + row_bytes;
        if (!fits(first, span, call->dst.len)) {
            PyErr_SetString(PyExc_ValueError, "the destination rows lie past its end");
            return 0;
        }
    }
    return 1;
}

static int get_buffers(Call *call, PyObject *codes, PyObject *dst, PyObject *rows) {
    memset(&call->codes, 0, sizeof(Py_buffer));
    memset(&call->dst, 0, sizeof(Py_buffer));
    memset(&call->rows, 0, sizeof(Py_buffer));
    if (PyObject_GetBuffer(codes, &call->codes, PyBUF_SIMPLE) != 0) {
        return 0;
    }
    if (PyObject_GetBuffer(dst, &call->dst, PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&call->codes);
        return 0;
    }
    if (PyObject_GetBuffer(rows, &call->rows, PyBUF_SIMPLE) != 0) {
        PyBuffer_Release(&call->codes);
        PyBuffer_Release(&call->dst);
        return 0;
    }
    return 1;
}

/* float32 -> bfloat16, rounded to nearest even (as torch converts); a NaN stays a quiet NaN.
 * Selects by masks rather than branches, so the loops that call it vectorize. */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    uint32_t nan = (uint32_t)0 - (uint32_t)((bits & 0x7FFFFFFFu) > 0x7F800000u);
    return (uint16_t)((((bits >> 16) | 0x40u) & nan) | (rounded & ~nan));
}

/* float32 -> IEEE half, rounded to nearest even (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t to_f16(float value) {
    const uint32_t f32_infinity = 255u << 23;
    const uint32_t f16_overflow = (127u + 16u) << 23;
    const uint32_t denormal_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint16_t half;
    if (bits >= f16_overflow) {
        half = bits > f32_infinity ? 0x7E00u : 0x7C00u;
    } else if (bits < (113u << 23)) { /* a half subnormal or zero: let float addition round */
        float magnitude, magic;
        memcpy(&magnitude, &bits, 4);
        memcpy(&magic, &denormal_magic_bits, 4);
        magnitude += magic;
        memcpy(&bits, &magnitude, 4);
        half = (uint16_t)(bits - denormal_magic_bits);
    } else {
        uint32_t odd = (bits >> 13) & 1u;
        bits += ((uint32_t)(15 - 127) << 23) + 0xFFFu;
        bits += odd;
        half = (uint16_t)(bits >> 13);
    }
    return (uint16_t)(half | (sign >> 16));
}

/* The value of e4m3 (float8_e4m3fn) code ``c``, built from its bits: the exponent rebiased
 * for a normal, the 3-bit mantissa times 2^-9 for a subnormal, NaN for S.1111.111 (e4m3fn has no
 * infinity). Exact: every e4m3 value is a float32. */
static inline float e4m3_value(uint8_t c) {
    uint32_t magnitude = c & 0x7Fu;
    uint32_t normal = (magnitude << 20) + (120u << 23);
    float small = (float)(int32_t)(magnitude & 7u) * 0.001953125f; /* 2^-9 */
    uint32_t subnormal;
    memcpy(&subnormal, &small, 4);
    uint32_t is_subnormal = (uint32_t)0 - (uint32_t)(magnitude < 8u);
    uint32_t is_nan = (uint32_t)0 - (uint32_t)(magnitude == 0x7Fu);
    uint32_t bits = (subnormal & is_subnormal) | (normal & ~is_subnormal);
    bits = (0xFFFFFFFFu & is_nan) | (bits & ~is_nan); /* the NaN torch's conversion gives */
    bits |= (uint32_t)(c & 0x80u) << 24;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

static PyObject *fp8_scaled(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *codes, *dst, *rows;
    Call call;
    long long kind;
    if (!PyArg_ParseTuple(args, "OLLOLLOLLL", &codes, &call.codes_offset, &call.codes_stride,
                          &dst, &call.dst_offset, &call.dst_stride, &rows, &call.tokens,
                          &call.width, &kind)) {
        return NULL;
    }
    if (kind != OUT_BF16 && kind != OUT_F16 && kind != OUT_F32) {
        PyErr_SetString(PyExc_ValueError, "unknown output kind");
        return NULL;
    }
    call.itemsize = kind == OUT_F32 ? 4 : 2;
    if (!get_buffers(&call, codes, dst, rows)) {
        return NULL;
    }
    if (!check_call(&call, call.tokens * call.width + 4)) {
        release(&call);
        return NULL;
    }
    const uint8_t *in = (const uint8_t *)call.codes.buf;
    uint8_t *out = (uint8_t *)call.dst.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (long long s = 0; s < call.segments; s++) {
        const uint8_t *src = in + call.codes_offset + s * call.codes_stride;
        float scale; /* the float32 after the codes, stored little-endian as torch wrote it */
        memcpy(&scale, src + call.tokens * call.width, 4);
        uint8_t *base = out + call.dst_offset + call.row_starts[s] * call.dst_stride;
        /* A segment's values are one of 256 codes times its scale: its 256 results, each the
         * float32 product rounded once to the output (what the torch path computes), then one
         * lookup per value. On portable SSE2 code the lookup took a third of the time of
         * computing every value (a vectorized conversion). */
        if (kind == OUT_F32) {
            uint32_t lut[256];
            for (int c = 0; c < 256; c++) {
                float value = e4m3_value((uint8_t)c) * scale;
                memcpy(&lut[c], &value, 4);
            }
            for (long long t = 0; t < call.tokens; t++, src += call.width) {
                uint8_t *row = base + t * call.dst_stride;
                for (long long i = 0; i < call.width; i++) {
                    memcpy(row + 4 * i, &lut[src[i]], 4);
                }
            }
            continue;
        }
        uint16_t lut[256];
        for (int c = 0; c < 256; c++) {
            float value = e4m3_value((uint8_t)c) * scale;
            lut[c] = kind == OUT_BF16 ? to_bf16(value) : to_f16(value);
        }
        for (long long t = 0; t < call.tokens; t++, src += call.width) {
            uint8_t *row = base + t * call.dst_stride;
            for (long long i = 0; i < call.width; i++) {
                memcpy(row + 2 * i, &lut[src[i]], 2);
            }
        }
    }
    Py_END_ALLOW_THREADS;
    release(&call);
    Py_RETURN_NONE;
}

#define MAX_GROUP 32

/* Groups decoded side by side: the transform's butterflies run over this many groups at
 * once, a loop the compiler vectorizes (1.7 times faster than one group at a time). */
#define LANES 16

/* ``count`` (at most LANES) consecutive groups of ``group`` values of one token's row. */
static ALWAYS_INLINE void int4_groups(const uint8_t *nibbles, const uint8_t *scales, uint8_t *row,
                                      int count, int group, float coefficient, int kind) {
    /* The codes are integers -7..7 and a group shares one scale, so the rotation of the group's
     * values is the scale times an integer Walsh-Hadamard transform of the codes: exact here,
     * where the torch path's float32 matrix product rounds each term. */
    int32_t x[MAX_GROUP][LANES];
    float scale[LANES];
    for (int g = 0; g < LANES; g++) {
        if (g < count) {
            const uint8_t *b = nibbles + g * (group / 2);
            for (int i = 0; i < group / 2; i++) {
                x[2 * i][g] = (int32_t)(b[i] & 0x0F) - 8;
                x[2 * i + 1][g] = (int32_t)(b[i] >> 4) - 8;
            }
            uint32_t bits = (uint32_t)(scales[2 * g] | (scales[2 * g + 1] << 8)) << 16;
            memcpy(&scale[g], &bits, 4);
        } else {
            for (int i = 0; i < group; i++) {
                x[i][g] = 0;
            }
            scale[g] = 0.0f;
        }
    }
    for (int h = 1; h < group; h *= 2) {
        for (int i = 0; i < group; i += 2 * h) {
            for (int j = i; j < i + h; j++) {
                for (int g = 0; g < LANES; g++) {
                    int32_t a = x[j][g], b = x[j + h][g];
                    x[j][g] = a + b;
                    x[j + h][g] = a - b;
                }
            }
        }
    }
    if (kind == OUT_F32) {
        for (int g = 0; g < count; g++) {
            uint8_t *dest = row + (size_t)g * (size_t)group * 4;
            for (int i = 0; i < group; i++) {
                float value = ((float)x[i][g] * scale[g]) * coefficient;
                memcpy(dest + 4 * i, &value, 4);
            }
        }
        return;
    }
    uint16_t y[MAX_GROUP][LANES];
    for (int i = 0; i < group; i++) {
        for (int g = 0; g < LANES; g++) {
            float value = ((float)x[i][g] * scale[g]) * coefficient;
            y[i][g] = kind == OUT_BF16 ? to_bf16(value) : to_f16(value);
        }
    }
    for (int g = 0; g < count; g++) {
        uint8_t *dest = row + (size_t)g * (size_t)group * 2;
        for (int i = 0; i < group; i++) {
            memcpy(dest + 2 * i, &y[i][g], 2);
        }
    }
}

/* One token's row of one int4 component: ``groups`` groups of ``group`` values. Inlined into
 * each caller, so that a constant group is unrolled. */
static ALWAYS_INLINE void int4_row(const uint8_t *nibbles, const uint8_t *scales, uint8_t *row,
                                   int groups, int group, float coefficient, int kind) {
    for (int g = 0; g < groups; g += LANES) {
        int count = groups - g < LANES ? groups - g : LANES;
        size_t itemsize = kind == OUT_F32 ? 4 : 2;
        int4_groups(nibbles + (size_t)g * (size_t)(group / 2), scales + 2 * (size_t)g,
                    row + (size_t)g * (size_t)group * itemsize, count, group, coefficient, kind);
    }
}

static PyObject *int4_hadamard(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *codes, *dst, *rows;
    Call call;
    long long group, kind;
    float coefficient;
    if (!PyArg_ParseTuple(args, "OLLOLLOLLLfL", &codes, &call.codes_offset, &call.codes_stride,
                          &dst, &call.dst_offset, &call.dst_stride, &rows, &call.tokens,
                          &call.width, &group, &coefficient, &kind)) {
        return NULL;
    }
    if (kind != OUT_BF16 && kind != OUT_F16 && kind != OUT_F32) {
        PyErr_SetString(PyExc_ValueError, "unknown output kind");
        return NULL;
    }
    call.itemsize = kind == OUT_F32 ? 4 : 2;
    if (group < 2 || group > MAX_GROUP || (group & (group - 1)) != 0 ||
        call.width % group != 0) {
        PyErr_SetString(PyExc_ValueError, "group must be a power of two (2..32) dividing width");
        return NULL;
    }
    if (!get_buffers(&call, codes, dst, rows)) {
        return NULL;
    }
    long long groups = call.width / group;
    long long packed = call.tokens * call.width / 2;
    if (!check_call(&call, packed + call.tokens * groups * 2)) {
        release(&call);
        return NULL;
    }
    const uint8_t *in = (const uint8_t *)call.codes.buf;
    uint8_t *out = (uint8_t *)call.dst.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (long long s = 0; s < call.segments; s++) {
        const uint8_t *nibbles = in + call.codes_offset + s * call.codes_stride;
        const uint8_t *scales = nibbles + packed;
        uint8_t *base = out + call.dst_offset + call.row_starts[s] * call.dst_stride;
        for (long long t = 0; t < call.tokens; t++) {
            uint8_t *row = base + t * call.dst_stride;
            /* The common group (32) by a copy of the loop the compiler unrolls. */
            if (group == 32) {
                int4_row(nibbles, scales, row, (int)groups, 32, coefficient, (int)kind);
            } else {
                int4_row(nibbles, scales, row, (int)groups, (int)group, coefficient, (int)kind);
            }
            nibbles += call.width / 2;
            scales += 2 * groups;
        }
    }
    Py_END_ALLOW_THREADS;
    release(&call);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fp8_scaled", fp8_scaled, METH_VARARGS,
     "fp8_scaled(codes, codes_offset, codes_stride, dst, dst_offset, dst_stride, row_starts,\n"
     "           tokens, width, kind) -> None\n\n"
     "Segment s's tokens*width e4m3 codes (at codes_offset + s*codes_stride of codes, then\n"
     "its float32 scale) times the scale, written as kind (0 bfloat16, 1 float16, 2 float32)\n"
     "to rows row_starts[s].. (int64) of dst: value i of row r at dst_offset + r*dst_stride +\n"
     "i*itemsize."},
    {"int4_hadamard", int4_hadamard, METH_VARARGS,
     "int4_hadamard(codes, codes_offset, codes_stride, dst, dst_offset, dst_stride,\n"
     "              row_starts, tokens, width, group, coefficient, kind) -> None\n\n"
     "Segment s's packed 4-bit codes (tokens*width/2 bytes at codes_offset + s*codes_stride,\n"
     "then tokens*width/group bfloat16 scales) rotated back by the Walsh-Hadamard matrix of\n"
     "group (entries +-coefficient) and written as kind (0 bfloat16, 1 float16, 2 float32)\n"
     "to rows row_starts[s].. of dst as fp8_scaled does."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tenantkv._codec_kernels",
    "One-pass CPU decoders of the fp8 and int4 latent codecs (tenantkv.codecs).", -1, methods,
};

PyMODINIT_FUNC PyInit__codec_kernels(void) { return PyModule_Create(&module); }

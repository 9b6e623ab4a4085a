/*
 * The CPU decoders of the lossy latent codecs (tenantkv.codecs), one pass from the opened codes
 * straight into the load's destination rows; and their CPU encoders (the store path, after the
 * decoders below), which store exactly the bytes of the torch encoders.
 *
 * Why C: decoding with torch operations takes several passes over memory per component (codes
 * widened to int32 or float32, looked up or converted, scaled, rounded to the model's dtype into
 * a temporary, then copied into the destination), and on a 2-core host that made a warm fp8 load
 * 5 times slower than reading twice the bytes under codec "none" (docs/perf.md, "Latent
 * codecs"). Here every output value is written once, from codes that stay in cache.
 *
 * Every function releases the GIL while it runs, so other threads (the loader's workers) run too.
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

/* ---- encoders (the store path) ------------------------------------------------------------
 *
 * Why C here too: the torch encoders made several float32 passes per component (widen, abs,
 * amax, divide, clamp, convert, concatenate) on torch's thread pool, and a coded store ran 17 to
 * 30 times slower than codec "none" on a loaded 2-core host. These write each code once. They compute exactly what the torch encoders compute, operation for
 * operation in float32 (the same IEEE divisions, torch's rounding of float32 to e4m3 and to
 * bfloat16, round half to even), so the stored bytes are the same (tests/test_codec_kernels.py
 * holds them to it on random, boundary and every-bfloat16 inputs). */

/* The value of a 16-bit float's bits, exactly (F. Giesen's half_to_float, by masks so that the
 * loops vectorize). Only finite values reach it: the callers refuse the others first. */
static inline float f16_value(uint16_t h) {
    uint32_t bits = ((uint32_t)h & 0x7FFFu) << 13;
    uint32_t is_small = (uint32_t)0 - (uint32_t)((bits & (0x7C00u << 13)) == 0);
    uint32_t normal = bits + ((127u - 15u) << 23);
    /* zero or subnormal: renormalized by an exact float subtraction */
    uint32_t small_bits = normal + (1u << 23), magic_bits = 113u << 23;
    float small, magic;
    memcpy(&small, &small_bits, 4);
    memcpy(&magic, &magic_bits, 4);
    small -= magic;
    memcpy(&small_bits, &small, 4);
    bits = (small_bits & is_small) | (normal & ~is_small);
    bits |= ((uint32_t)h & 0x8000u) << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* Value i of a row of the input kind, as float32 (exact: every input value is a float32). */
static ALWAYS_INLINE float in_value(const uint8_t *row, long long i, int kind) {
    if (kind == OUT_F32) {
        float value;
        memcpy(&value, row + 4 * i, 4);
        return value;
    }
    uint16_t half;
    memcpy(&half, row + 2 * i, 2);
    if (kind == OUT_BF16) {
        uint32_t bits = (uint32_t)half << 16;
        float value;
        memcpy(&value, &bits, 4);
        return value;
    }
    return f16_value(half);
}

/* The largest magnitude among ``tokens`` rows of ``width`` values (their bits with the sign
 * cleared, compared as integers: for finite values the same order as the values'), and whether
 * one of them is an infinity or NaN (its exponent all ones). */
static ALWAYS_INLINE float amax_rows(const uint8_t *base, long long stride, long long tokens,
                                     long long width, int kind, int *non_finite) {
    if (kind == OUT_F32) {
        uint32_t top = 0;
        for (long long t = 0; t < tokens; t++) {
            const uint8_t *row = base + t * stride;
            for (long long i = 0; i < width; i++) {
                uint32_t bits;
                memcpy(&bits, row + 4 * i, 4);
                bits &= 0x7FFFFFFFu;
                top = bits > top ? bits : top;
            }
        }
        *non_finite = top >= 0x7F800000u;
        float value;
        memcpy(&value, &top, 4);
        return value;
    }
    uint16_t top = 0;
    for (long long t = 0; t < tokens; t++) {
        const uint8_t *row = base + t * stride;
        for (long long i = 0; i < width; i++) {
            uint16_t bits;
            memcpy(&bits, row + 2 * i, 2);
            bits &= 0x7FFFu;
            top = bits > top ? bits : top;
        }
    }
    if (kind == OUT_BF16) {
        *non_finite = top >= 0x7F80u;
        uint32_t wide = (uint32_t)top << 16;
        float value;
        memcpy(&value, &wide, 4);
        return value;
    }
    *non_finite = top >= 0x7C00u;
    return *non_finite ? 0.0f : f16_value(top);
}

/* torch's clamp(-448, 448) then its float32 -> e4m3 (float8_e4m3fn) conversion (c10's
 * fp8e4m3fn_from_fp32_value): round to nearest even, a subnormal by an exact float addition, a
 * magnitude above 448 (infinity too) to 448 (0x7E) as the clamp makes it, NaN to 0x7F (the clamp
 * keeps a NaN); the sign kept. One function, selecting by masks, so that the loop vectorizes
 * (the clamp's comparisons kept it scalar). */
static inline uint8_t clamped_e4m3(float value) {
    const uint32_t fp8_max = 0x43E00000u; /* 448.0f */
    const uint32_t denorm_mask = 141u << 23;
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    float magnitude, magic;
    memcpy(&magnitude, &bits, 4);
    memcpy(&magic, &denorm_mask, 4);
    float shifted = magnitude + magic;
    uint32_t small;
    memcpy(&small, &shifted, 4);
    small -= denorm_mask;
    uint32_t odd = (bits >> 20) & 1u;
    uint32_t normal = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd) >> 20;
    uint32_t is_small = (uint32_t)0 - (uint32_t)(bits < (121u << 23));
    uint32_t result = (small & is_small) | (normal & ~is_small);
    uint32_t big = (uint32_t)0 - (uint32_t)(bits > fp8_max);
    uint32_t nan = (uint32_t)0 - (uint32_t)(bits > 0x7F800000u);
    uint32_t saturated = (0x7Fu & nan) | (0x7Eu & ~nan);
    result = (saturated & big) | (result & ~big);
    return (uint8_t)((result & 0xFFu) | (sign >> 24));
}

/* The layout of one encode call, read from the Python arguments and checked. */
typedef struct {
    Py_buffer values, out;
    long long values_offset, row_stride, segments, tokens, width, out_offset, out_stride;
    long long itemsize;
} Encode;

static int get_encode_buffers(Encode *call, PyObject *values, PyObject *out) {
    memset(&call->values, 0, sizeof(Py_buffer));
    memset(&call->out, 0, sizeof(Py_buffer));
    if (PyObject_GetBuffer(values, &call->values, PyBUF_SIMPLE) != 0) {
        return 0;
    }
    if (PyObject_GetBuffer(out, &call->out, PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&call->values);
        return 0;
    }
    return 1;
}

static void release_encode(Encode *call) {
    PyBuffer_Release(&call->values);
    PyBuffer_Release(&call->out);
}

/* Check that every segment's rows of values and its ``out_bytes`` bytes of output lie within
 * their buffers; 0 with ValueError set when they do not. Products are formed only once a
 * division shows they stay within a buffer's size, so none can overflow. */
static int check_encode(Encode *call, long long out_bytes) {
    const char *names[] = {"values_offset", "row_stride", "segments",  "tokens",
                           "width",         "out_offset", "out_stride"};
    long long values[] = {call->values_offset, call->row_stride, call->segments, call->tokens,
                          call->width,         call->out_offset, call->out_stride};
    for (int i = 0; i < 7; i++) {
        if (!in_range(values[i], names[i])) {
            return 0;
        }
    }
    if (call->segments == 0) {
        return 1;
    }
    if (call->tokens == 0 || call->width == 0) {
        PyErr_SetString(PyExc_ValueError, "tokens and width must be positive");
        return 0;
    }
    if (call->tokens > ((long long)1 << 31) || call->width > ((long long)1 << 31) ||
        call->segments > ((long long)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "segments, tokens or width out of range");
        return 0;
    }
    long long row_bytes = call->width * call->itemsize;
    if (row_bytes > call->row_stride) {
        PyErr_SetString(PyExc_ValueError, "a row's values are wider than the row stride");
        return 0;
    }
    long long rows = call->segments * call->tokens;
    if (rows - 1 > call->values.len / call->row_stride ||
        !fits(call->values_offset + (rows - 1) * call->row_stride, row_bytes,
              call->values.len)) {
        PyErr_SetString(PyExc_ValueError, "the values lie past the end of their buffer");
        return 0;
    }
    if (out_bytes > call->out_stride) {
        PyErr_SetString(PyExc_ValueError, "a segment's codes are wider than the output stride");
        return 0;
    }
    if (call->segments - 1 > call->out.len / call->out_stride ||
        !fits(call->out_offset + (call->segments - 1) * call->out_stride, out_bytes,
              call->out.len)) {
        PyErr_SetString(PyExc_ValueError, "the codes lie past the end of their buffer");
        return 0;
    }
    return 1;
}

/* ``tokens`` rows of ``width`` values as e4m3 codes of value / scale, row after row. */
static ALWAYS_INLINE void fp8_rows(const uint8_t *base, long long stride, long long tokens,
                                   long long width, uint8_t *codes, float scale, int kind) {
    for (long long t = 0; t < tokens; t++, codes += width) {
        const uint8_t *row = base + t * stride;
        for (long long i = 0; i < width; i++) {
            codes[i] = clamped_e4m3(in_value(row, i, kind) / scale);
        }
    }
}

static PyObject *fp8_encode(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *values, *out;
    Encode call;
    long long kind;
    if (!PyArg_ParseTuple(args, "OLLLLLLOLL", &values, &kind, &call.values_offset,
                          &call.row_stride, &call.segments, &call.tokens, &call.width, &out,
                          &call.out_offset, &call.out_stride)) {
        return NULL;
    }
    if (kind != OUT_BF16 && kind != OUT_F16 && kind != OUT_F32) {
        PyErr_SetString(PyExc_ValueError, "unknown input kind");
        return NULL;
    }
    call.itemsize = kind == OUT_F32 ? 4 : 2;
    if (!get_encode_buffers(&call, values, out)) {
        return NULL;
    }
    if (!check_encode(&call, call.tokens * call.width + 4)) {
        release_encode(&call);
        return NULL;
    }
    const uint8_t *in = (const uint8_t *)call.values.buf + call.values_offset;
    uint8_t *dst = (uint8_t *)call.out.buf + call.out_offset;
    /* Each segment's amax, from the pass that checks them all (one read of the values less) */
    float *amaxes = PyMem_Malloc((size_t)(call.segments ? call.segments : 1) * sizeof(float));
    if (amaxes == NULL) {
        release_encode(&call);
        return PyErr_NoMemory();
    }
    int non_finite = 0;
    Py_BEGIN_ALLOW_THREADS;
    /* The first pass checks every segment, so that a refused encode writes nothing. */
    long long segment_rows = call.tokens * call.row_stride;
    for (long long s = 0; s < call.segments && !non_finite; s++) {
        amaxes[s] = amax_rows(in + s * segment_rows, call.row_stride, call.tokens, call.width,
                              (int)kind, &non_finite);
    }
    for (long long s = 0; s < call.segments && !non_finite; s++) {
        const uint8_t *base = in + s * segment_rows;
        uint8_t *codes = dst + s * call.out_stride;
        float amax = amaxes[s];
        /* torch: where(amax > 0, amax / 448, 1), in float32 */
        float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        /* One copy of the loop per input kind, each of which the compiler vectorizes. */
        if (kind == OUT_BF16) {
            fp8_rows(base, call.row_stride, call.tokens, call.width, codes, scale, OUT_BF16);
        } else if (kind == OUT_F16) {
            fp8_rows(base, call.row_stride, call.tokens, call.width, codes, scale, OUT_F16);
        } else {
            fp8_rows(base, call.row_stride, call.tokens, call.width, codes, scale, OUT_F32);
        }
        memcpy(codes + call.tokens * call.width, &scale, 4);
    }
    Py_END_ALLOW_THREADS;
    PyMem_Free(amaxes);
    release_encode(&call);
    if (non_finite) {
        PyErr_SetString(PyExc_ValueError, "a value is not finite");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Round half to even of a float32 in [-7, 7] (torch's round_): adding and subtracting 1.5 * 2^23
 * leaves the nearest integer under the default rounding mode, with no libm call. */
static ALWAYS_INLINE float round_even(float value) {
    const float magic = 12582912.0f; /* no -ffast-math: the compiler keeps both roundings */
    return (value + magic) - magic;
}

/* One token's row of ``groups`` groups of ``group`` rotated values as packed codes and
 * bfloat16 scales, as _Int4Part.encode computes them. */
static ALWAYS_INLINE void int4_encode_row(const float *x, uint8_t *nibbles, uint8_t *scales,
                                          long long groups, int group) {
    for (long long g = 0; g < groups; g++, x += group) {
        /* amax by the magnitudes' bits as integers (finite values: the same order) */
        int32_t top = 0;
        for (int i = 0; i < group; i++) {
            int32_t bits;
            memcpy(&bits, x + i, 4);
            bits &= 0x7FFFFFFF;
            top = bits > top ? bits : top;
        }
        float amax;
        memcpy(&amax, &top, 4);
        /* torch: (amax / 7).to(bfloat16), widened back; 1 where it is 0 */
        uint16_t scale = to_bf16(amax / 7.0f);
        uint32_t wide_bits = (uint32_t)scale << 16;
        float wide;
        memcpy(&wide, &wide_bits, 4);
        float safe = wide > 0.0f ? wide : 1.0f;
        memcpy(scales + 2 * g, &scale, 2);
        /* torch: (x / safe).round_().clamp_(-7, 7) + 8. |x / safe| stays below 11 (a bfloat16
         * scale is at worst a third below amax / 7, where it is subnormal), so the rounding
         * trick applies, and the clamp of the integer is the clamp of the float. */
        uint8_t q[MAX_GROUP];
        for (int i = 0; i < group; i++) {
            int32_t code = (int32_t)round_even(x[i] / safe);
            code = code < -7 ? -7 : (code > 7 ? 7 : code);
            q[i] = (uint8_t)(code + 8);
        }
        uint8_t *pack = nibbles + g * (group / 2);
        for (int i = 0; i < group / 2; i++) {
            pack[i] = (uint8_t)(q[2 * i] | (q[2 * i + 1] << 4));
        }
    }
}

static PyObject *int4_encode(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *values, *out;
    Encode call;
    long long group;
    if (!PyArg_ParseTuple(args, "OLLLLLOLL", &values, &call.segments, &call.tokens, &call.width,
                          &group, &call.values_offset, &out, &call.out_offset,
                          &call.out_stride)) {
        return NULL;
    }
    call.itemsize = 4;
    if (group < 2 || group > MAX_GROUP || (group & (group - 1)) != 0 ||
        call.width % group != 0) {
        PyErr_SetString(PyExc_ValueError, "group must be a power of two (2..32) dividing width");
        return NULL;
    }
    if (call.values_offset != 0) {
        PyErr_SetString(PyExc_ValueError, "values_offset must be 0");
        return NULL;
    }
    if (!get_encode_buffers(&call, values, out)) {
        return NULL;
    }
    call.row_stride = call.width * 4;
    long long groups = call.width / group;
    long long packed = call.tokens * call.width / 2;
    if (!check_encode(&call, packed + call.tokens * groups * 2)) {
        release_encode(&call);
        return NULL;
    }
    const float *in = (const float *)call.values.buf;
    uint8_t *dst = (uint8_t *)call.out.buf + call.out_offset;
    int non_finite = 0;
    long long total = call.segments * call.tokens * call.width;
    Py_BEGIN_ALLOW_THREADS;
    /* A rotation of finite values can overflow float32; such values are left to the torch
     * path (whose results for them this does not reproduce), before anything is written. */
    uint32_t top = 0;
    for (long long i = 0; i < total; i++) {
        uint32_t bits;
        memcpy(&bits, in + i, 4);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    non_finite = top >= 0x7F800000u;
    for (long long s = 0; s < call.segments && !non_finite; s++) {
        uint8_t *nibbles = dst + s * call.out_stride;
        uint8_t *scales = nibbles + packed;
        for (long long t = 0; t < call.tokens; t++) {
            const float *x = in + (s * call.tokens + t) * call.width;
            /* The common group (32) by a copy of the loop the compiler unrolls. */
            if (group == 32) {
                int4_encode_row(x, nibbles, scales, groups, 32);
            } else {
                int4_encode_row(x, nibbles, scales, groups, (int)group);
            }
            nibbles += call.width / 2;
            scales += 2 * groups;
        }
    }
    Py_END_ALLOW_THREADS;
    release_encode(&call);
    if (non_finite) {
        PyErr_SetString(PyExc_ValueError, "a value is not finite");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Whether every value of a buffer of one kind is finite: a scan of the bits (a value is not
 * finite when its exponent is all ones) at memory speed, where torch's isfinite().all() on
 * bfloat16 took six times as long as an fp8 encode of the layer (docs/perf.md). */
static PyObject *all_finite(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *values;
    long long kind;
    if (!PyArg_ParseTuple(args, "OL", &values, &kind)) {
        return NULL;
    }
    if (kind != OUT_BF16 && kind != OUT_F16 && kind != OUT_F32) {
        PyErr_SetString(PyExc_ValueError, "unknown input kind");
        return NULL;
    }
    Py_buffer buffer;
    if (PyObject_GetBuffer(values, &buffer, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    long long itemsize = kind == OUT_F32 ? 4 : 2;
    if (buffer.len % itemsize != 0) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "the buffer is not a whole number of values");
        return NULL;
    }
    long long count = buffer.len / itemsize;
    const uint8_t *in = (const uint8_t *)buffer.buf;
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS;
    /* In chunks, so that a non-finite value ends the scan early without a branch per value. */
    for (long long start = 0; start < count && finite; start += 4096) {
        long long end = count - start < 4096 ? count : start + 4096;
        if (kind == OUT_F32) {
            uint32_t top = 0;
            for (long long i = start; i < end; i++) {
                uint32_t bits;
                memcpy(&bits, in + 4 * i, 4);
                bits &= 0x7F800000u;
                top = bits > top ? bits : top;
            }
            finite = top != 0x7F800000u;
        } else {
            uint16_t mask = kind == OUT_BF16 ? 0x7F80u : 0x7C00u, top = 0;
            for (long long i = start; i < end; i++) {
                uint16_t bits;
                memcpy(&bits, in + 2 * i, 2);
                bits &= mask;
                top = bits > top ? bits : top;
            }
            finite = top != mask;
        }
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&buffer);
    return PyBool_FromLong(finite);
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
    {"all_finite", all_finite, METH_VARARGS,
     "all_finite(values, kind) -> bool\n\n"
     "Whether every value of the buffer (kind 0 bfloat16, 1 float16, 2 float32) is finite."},
    {"fp8_encode", fp8_encode, METH_VARARGS,
     "fp8_encode(values, kind, values_offset, row_stride, segments, tokens, width, out,\n"
     "           out_offset, out_stride) -> None\n\n"
     "Segment s's tokens rows (s*tokens.. of values, kind 0 bfloat16, 1 float16, 2 float32;\n"
     "value i of row r at values_offset + r*row_stride + i*itemsize) as e4m3 codes scaled by\n"
     "their amax/448, then the float32 scale, at out_offset + s*out_stride of out, as\n"
     "tenantkv.codecs' torch encoder writes them. ValueError, and nothing written, when a\n"
     "value is not finite."},
    {"int4_encode", int4_encode, METH_VARARGS,
     "int4_encode(values, segments, tokens, width, group, values_offset, out, out_offset,\n"
     "            out_stride) -> None\n\n"
     "Rotated float32 values (segments*tokens rows of width, contiguous) as 4-bit codes with a\n"
     "bfloat16 scale (amax/7) per group, packed as tenantkv.codecs' torch encoder packs them,\n"
     "at out_offset + s*out_stride of out. ValueError, and nothing written, when a value is\n"
     "not finite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tenantkv._codec_kernels",
    "One-pass CPU decoders and encoders of the fp8 and int4 latent codecs (tenantkv.codecs).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__codec_kernels(void) { return PyModule_Create(&module); }

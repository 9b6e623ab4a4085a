/*
 * The keyed BLAKE2b-256 chain of tenantkv.prefix.block_keys, in one call.
 *
 * Why C: a 128K-token lookup hashes 2,048 blocks one after another (each key chains the one
 * before), and through hashlib each block costs four Python calls and three objects besides its
 * three compressions: about 0.75 us a block, 45% of it the calls. Here the loop runs without the
 * interpreter (and, for the longest prompts, without the GIL), and the keys are the same bytes: tenantkv.prefix keeps the
 * hashlib loop as the reference and as the fallback where this module was not built, and the
 * tests compare the two.
 *
 * BLAKE2b as RFC 7693 specifies it: digest length 32, key length 32 (at most 64), the
 * personalisation in the parameter block, no salt, sequential mode.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLAKE2B_BLOCK 128
#define DIGEST_BYTES 32
#define MAX_KEY_BYTES 64
#define PERSON_BYTES 16
/* Prompts of at least this many bytes of tokens (1M tokens: ~7 ms of hashing) are hashed without
 * the GIL, so that other threads run meanwhile. Shorter ones keep it: taking the GIL back can
 * wait for another thread's switch interval (5 ms), which would cost a 8K-token load more than
 * its whole chain (~60 us). hashlib keeps it for updates under 2 KiB, as the loop did. */
#define RELEASE_GIL_BYTES (4 << 20)

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* Round r uses row r % 10 (rounds 10 and 11 repeat rows 0 and 1). */
static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t load64(const uint8_t *p) {
    /* little-endian on every host; compilers turn this into one load on x86 and arm64 */
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static inline uint64_t rotr64(uint64_t v, unsigned n) { return (v >> n) | (v << (64 - n)); }

#define G(r, i, a, b, c, d)                          \
    do {                                             \
        a = a + b + m[SIGMA[(r) % 10][2 * (i)]];     \
        d = rotr64(d ^ a, 32);                       \
        c = c + d;                                   \
        b = rotr64(b ^ c, 24);                       \
        a = a + b + m[SIGMA[(r) % 10][2 * (i) + 1]]; \
        d = rotr64(d ^ a, 16);                       \
        c = c + d;                                   \
        b = rotr64(b ^ c, 63);                       \
    } while (0)

#define ROUND(r)                              \
    do {                                      \
        G(r, 0, v[0], v[4], v[8], v[12]);     \
        G(r, 1, v[1], v[5], v[9], v[13]);     \
        G(r, 2, v[2], v[6], v[10], v[14]);    \
        G(r, 3, v[3], v[7], v[11], v[15]);    \
        G(r, 4, v[0], v[5], v[10], v[15]);    \
        G(r, 5, v[1], v[6], v[11], v[12]);    \
        G(r, 6, v[2], v[7], v[8], v[13]);     \
        G(r, 7, v[3], v[4], v[9], v[14]);     \
    } while (0)

/* One compression of the 128-byte block ``block`` into ``h``; ``t`` counts the bytes hashed so
 * far including this block, ``last`` marks the final block. */
static void compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t m[16];
    uint64_t v[16];
    for (int i = 0; i < 16; i++) {
        m[i] = load64(block + 8 * i);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* the high word of the counter stays 0: no chain hashes 2^64 bytes */
    if (last) {
        v[14] = ~v[14];
    }
    /* rounds written out, so that every SIGMA index is a constant the compiler folds */
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
    for (int i = 0; i < 8; i++) {
        h[i] ^= v[i] ^ v[i + 8];
    }
}

/* The keys of ``count`` blocks of ``block_bytes`` bytes of ``data``, chained from ``seed``,
 * written one after another into ``out`` (``count`` x 32 bytes). ``keyed`` is the state after
 * the key block (the first compression of every keyed BLAKE2b, done once). ``message`` is
 * scratch of 32 + block_bytes bytes, rounded up to whole BLAKE2b blocks and zeroed past the end
 * (the final block's padding). */
static void chain(const uint64_t keyed[8], const uint8_t *seed, const uint8_t *data,
                  Py_ssize_t block_bytes, Py_ssize_t count, uint8_t *message, uint8_t *out) {
    const Py_ssize_t length = DIGEST_BYTES + block_bytes;
    const uint8_t *previous = seed;
    for (Py_ssize_t index = 0; index < count; index++) {
        uint64_t h[8];
        memcpy(h, keyed, sizeof(h));
        memcpy(message, previous, DIGEST_BYTES);
        memcpy(message + DIGEST_BYTES, data + index * block_bytes, (size_t)block_bytes);
        uint64_t hashed = BLAKE2B_BLOCK; /* the key block */
        Py_ssize_t offset = 0;
        while (length - offset > BLAKE2B_BLOCK) {
            hashed += BLAKE2B_BLOCK;
            compress(h, message + offset, hashed, 0);
            offset += BLAKE2B_BLOCK;
        }
        hashed += (uint64_t)(length - offset);
        compress(h, message + offset, hashed, 1);
        uint8_t *key = out + index * DIGEST_BYTES;
        for (int i = 0; i < DIGEST_BYTES / 8; i++) {
            store64(key + 8 * i, h[i]);
        }
        previous = key;
    }
}

static PyObject *block_keys(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer key, person, seed, data;
    Py_ssize_t block_bytes;
    if (!PyArg_ParseTuple(args, "y*y*y*y*n", &key, &person, &seed, &data, &block_bytes)) {
        return NULL;
    }
    PyObject *result = NULL;
    uint8_t *scratch = NULL;
    if (key.len < 1 || key.len > MAX_KEY_BYTES || person.len > PERSON_BYTES ||
        seed.len != DIGEST_BYTES || block_bytes < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "key must be 1-64 bytes, person at most 16, seed 32, block_bytes >= 1");
        goto done;
    }
    const Py_ssize_t count = data.len / block_bytes;
    /* the message (padded to whole blocks, the padding zero) and then the keys */
    const Py_ssize_t padded =
        (DIGEST_BYTES + block_bytes + BLAKE2B_BLOCK - 1) / BLAKE2B_BLOCK * BLAKE2B_BLOCK;
    if (count > (PY_SSIZE_T_MAX - padded) / DIGEST_BYTES) {
        PyErr_NoMemory();
        goto done;
    }
    scratch = PyMem_Calloc(1, (size_t)(padded + count * DIGEST_BYTES));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t *out = scratch + padded;

    uint64_t keyed[8];
    uint8_t param[64] = {0};
    param[0] = DIGEST_BYTES;
    param[1] = (uint8_t)key.len;
    param[2] = 1; /* fanout */
    param[3] = 1; /* depth */
    memcpy(param + 48, person.buf, (size_t)person.len);
    for (int i = 0; i < 8; i++) {
        keyed[i] = IV[i] ^ load64(param + 8 * i);
    }
    uint8_t key_block[BLAKE2B_BLOCK] = {0};
    memcpy(key_block, key.buf, (size_t)key.len);
    compress(keyed, key_block, BLAKE2B_BLOCK, 0);
    memset(key_block, 0, sizeof(key_block));

    if (count * block_bytes >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        chain(keyed, seed.buf, data.buf, block_bytes, count, scratch, out);
        Py_END_ALLOW_THREADS
    } else {
        chain(keyed, seed.buf, data.buf, block_bytes, count, scratch, out);
    }
    memset(keyed, 0, sizeof(keyed));

    result = PyList_New(count);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *digest =
            PyBytes_FromStringAndSize((const char *)out + index * DIGEST_BYTES, DIGEST_BYTES);
        if (digest == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, index, digest);
    }

done:
    PyMem_Free(scratch);
    PyBuffer_Release(&key);
    PyBuffer_Release(&person);
    PyBuffer_Release(&seed);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"block_keys", block_keys, METH_VARARGS,
     "block_keys(key, person, seed, data, block_bytes) -> list[bytes]\n\n"
     "The keyed BLAKE2b-256 chain of every whole block of data (see tenantkv.prefix)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tenantkv._prefix_chain",
    "The keyed BLAKE2b chain of tenantkv.prefix.block_keys in C (same keys, one call).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__prefix_chain(void) { return PyModule_Create(&module); }

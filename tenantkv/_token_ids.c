/*
 * Token ids given as a Python list or tuple, packed as native uint32 in one pass (see
 * tenantkv.tokens.as_token_array).
 *
 * Why C: engines hold prompts as lists of ints (vLLM's prompt_token_ids), and a 128K-token
 * list took array.array about 0.7 ms to pack, a third of a whole lookup. Here an int costs a
 * type check and a read of its value. The rules are array.array('I')'s, except that booleans
 * are refused here rather than afterwards: an int (or any object with __index__, like numpy's
 * integers) in [0, 2**32) is an id; a bool raises ValueError; an id out of range raises
 * OverflowError; anything else (floats, strings, nested lists) raises TypeError.
 * tenantkv.tokens keeps array.array as the fallback where this module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The id ``item`` stands for, or -1 with an exception set. */
static long long token_id(PyObject *item) {
    if (PyBool_Check(item)) {
        PyErr_SetString(PyExc_ValueError, "booleans are not token ids");
        return -1;
    }
    PyObject *number = NULL;
    if (!PyLong_Check(item)) {
        number = PyNumber_Index(item); /* TypeError for floats, strings, lists */
        if (number == NULL) {
            return -1;
        }
        item = number;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    Py_XDECREF(number);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow != 0 || value < 0 || value > (long long)UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "token id out of range");
        return -1;
    }
    return value;
}

static PyObject *pack(PyObject *module, PyObject *tokens) {
    (void)module;
    if (!PyList_Check(tokens) && !PyTuple_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list or a tuple");
        return NULL;
    }
    /* A list's length is read once: its items are read with the GIL held and no call out of
     * this loop can run Python code that changes the list (PyNumber_Index can: then the
     * length is checked again). */
    Py_ssize_t count = PySequence_Fast_GET_SIZE(tokens);
    PyObject *packed = PyByteArray_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(uint32_t));
    if (packed == NULL) {
        return NULL;
    }
    uint32_t *out = (uint32_t *)PyByteArray_AS_STRING(packed);
    for (Py_ssize_t index = 0; index < count; index++) {
        if (index >= PySequence_Fast_GET_SIZE(tokens)) {
            PyErr_SetString(PyExc_RuntimeError, "tokens changed size while being packed");
            Py_DECREF(packed);
            return NULL;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(tokens, index);
        uint32_t value;
        if (PyLong_CheckExact(item)) { /* the common case, without a call out */
            int overflow = 0;
            long long wide = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow != 0 || wide < 0 || wide > (long long)UINT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "token id out of range");
                Py_DECREF(packed);
                return NULL;
            }
            value = (uint32_t)wide;
        } else {
            Py_INCREF(item); /* __index__ may drop the list's reference to it */
            long long wide = token_id(item);
            Py_DECREF(item);
            if (wide < 0) {
                Py_DECREF(packed);
                return NULL;
            }
            value = (uint32_t)wide;
        }
        out[index] = value;
    }
    return packed;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_O,
     "pack(tokens: list | tuple) -> bytearray\n\n"
     "The ids, as native uint32 (see tenantkv.tokens.as_token_array)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tenantkv._token_ids",
    "Token ids of a list or tuple packed as uint32 in one pass (tenantkv.tokens).", -1, methods,
};

PyMODINIT_FUNC PyInit__token_ids(void) { return PyModule_Create(&module); }

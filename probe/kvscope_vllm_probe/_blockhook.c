/* The block hook in C: KVCacheBlock's attribute writes, with the two the probe records passed to Python.
 *
 * Why C: every write to a block passes through a class's __setattr__, and vLLM writes a block's free-queue
 * links (prev_free_block, next_free_block) two to four times for each ref count it writes. A __setattr__ in
 * Python is a frame for each of them; this is a C call that stores the links as the class would and calls
 * Python only for a changed ref_cnt or _block_hash (recorder.py's Python hook is the same rule, and the one used
 * where this module was not built).
 *
 * install(cls) points the class's tp_setattro here (the type's __dict__ is left as it was: vLLM, reading
 * KVCacheBlock.__setattr__, finds object's); uninstall(cls) puts the class's own back. set_callbacks(on_ref,
 * on_hash) names what a change calls (None: record nothing): on_ref(block, value, old), on_hash(block, value).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_ref_cnt;     /* "ref_cnt", interned */
static PyObject *s_block_hash;  /* "_block_hash", interned */
static PyObject *on_ref;        /* a callable, or NULL */
static PyObject *on_hash;
static PyTypeObject *hooked;    /* the class whose writes come here */
static setattrofunc own;        /* its own tp_setattro, put back by uninstall */

/* name is one of the two recorded names: pointer first (names written in code are interned), text if not */
static int is_name(PyObject *name, PyObject *interned) {
    if (name == interned) return 1;
    if (!PyUnicode_CheckExact(name) || PyUnicode_CHECK_INTERNED(name)) return 0;
    return PyUnicode_Compare(name, interned) == 0;
}

static int hooked_setattro(PyObject *self, PyObject *name, PyObject *value) {
    PyObject *callback = NULL;
    if (is_name(name, s_ref_cnt)) {
        callback = on_ref;
    } else if (is_name(name, s_block_hash)) {
        callback = on_hash;
    }
    if (callback == NULL || value == NULL) {
        return own(self, name, value);  /* the links and the rest, a delete, or nothing recording */
    }
    PyObject *old = PyObject_GenericGetAttr(self, name);
    if (old == NULL) {  /* __init__ setting it the first time: nothing to record */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return own(self, name, value);
    }
    if (own(self, name, value) < 0) {
        Py_DECREF(old);
        return -1;
    }
    int changed = old != value;
    if (changed) {
        changed = PyObject_RichCompareBool(old, value, Py_NE);
        if (changed < 0) {
            Py_DECREF(old);
            return -1;
        }
    }
    PyObject *result = NULL;
    if (changed) {
        Py_INCREF(callback);  /* set_callbacks may replace it while Python runs */
        result = callback == on_ref ? PyObject_CallFunctionObjArgs(callback, self, value, old, NULL)
                                    : PyObject_CallFunctionObjArgs(callback, self, value, NULL);
        Py_DECREF(callback);
        if (result == NULL) {
            Py_DECREF(old);
            return -1;
        }
        Py_DECREF(result);
    }
    Py_DECREF(old);
    return 0;
}

static PyObject *install(PyObject *module, PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "install() takes a class");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    if (hooked != NULL && hooked != type) {
        PyErr_SetString(PyExc_RuntimeError, "the block hook is installed on another class");
        return NULL;
    }
    if (hooked == NULL) {
        own = type->tp_setattro;
        Py_INCREF(cls);
        hooked = type;
    }
    type->tp_setattro = hooked_setattro;
    PyType_Modified(type);
    Py_RETURN_NONE;
}

static PyObject *uninstall(PyObject *module, PyObject *cls) {
    if (hooked != NULL && (PyObject *)hooked == cls) {
        hooked->tp_setattro = own;
        PyType_Modified(hooked);
    }
    Py_RETURN_NONE;
}

static PyObject *installed(PyObject *module, PyObject *cls) {
    return PyBool_FromLong(PyType_Check(cls) && ((PyTypeObject *)cls)->tp_setattro == hooked_setattro);
}

static int set_one(PyObject **slot, PyObject *callable) {
    if (callable != Py_None && !PyCallable_Check(callable)) {
        PyErr_SetString(PyExc_TypeError, "a callback must be callable or None");
        return -1;
    }
    PyObject *previous = *slot;
    if (callable == Py_None) {
        *slot = NULL;
    } else {
        Py_INCREF(callable);
        *slot = callable;
    }
    Py_XDECREF(previous);
    return 0;
}

static PyObject *set_callbacks(PyObject *module, PyObject *args) {
    PyObject *ref, *hash;
    if (!PyArg_ParseTuple(args, "OO", &ref, &hash)) return NULL;
    if (set_one(&on_ref, ref) < 0 || set_one(&on_hash, hash) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"install", install, METH_O, "Route the class's attribute writes through the hook."},
    {"uninstall", uninstall, METH_O, "Give the class its own attribute writes back."},
    {"installed", installed, METH_O, "Whether the class's writes go through the hook."},
    {"set_callbacks", set_callbacks, METH_VARARGS, "on_ref(block, value, old), on_hash(block, value), or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_blockhook", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhook(void) {
    s_ref_cnt = PyUnicode_InternFromString("ref_cnt");
    s_block_hash = PyUnicode_InternFromString("_block_hash");
    if (s_ref_cnt == NULL || s_block_hash == NULL) return NULL;
    return PyModule_Create(&module_def);
}

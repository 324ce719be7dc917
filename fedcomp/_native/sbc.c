/* fedcomp._native._sbc: C kernels (placeholder module; kernels to come). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyMethodDef methods[] = {{NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sbc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sbc(void) { return PyModule_Create(&module); }

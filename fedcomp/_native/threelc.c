/* fedcomp._native._threelc: C kernels (placeholder module; kernels to come). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyMethodDef methods[] = {{NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_threelc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__threelc(void) { return PyModule_Create(&module); }

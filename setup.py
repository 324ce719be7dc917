"""Build script for fedcomp's optional C kernels (everything else is in pyproject.toml).

Each kernel is an ``optional`` extension: where no C compiler is available the build prints a
warning and the package installs without it, and :mod:`fedcomp._native` then reports the kernel
missing and the codecs use their NumPy paths, which give the same bytes (tested).
"""

from setuptools import Extension, setup

# -O3 only: no -march, so a built wheel runs on any x86-64 or arm64 machine of its platform.
_FLAGS = ["-O3", "-std=c99", "-fno-strict-aliasing"]

setup(
    ext_modules=[
        Extension(
            f"fedcomp._native._{name}",
            [f"fedcomp/_native/{name}.c"],
            depends=["fedcomp/_native/team.h"],  # (sbc.c and wire.c run work on threads through it)
            optional=True,
            extra_compile_args=_FLAGS,
        )
        for name in ("sbc", "threelc", "wire")
    ]
)

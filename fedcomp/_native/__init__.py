"""Optional C kernels for the CPU codec paths, and the switch that turns them off.

The kernels (``fedcomp/_native/*.c``, built by ``setup.py`` as optional extensions when the package
is installed) do in one pass over a tensor what the NumPy paths do in several: they exist for speed
only. Every codec that uses one keeps its NumPy path, and the two give the same bytes: the golden
fixtures and the tests run both.

``FEDCOMP_NATIVE=0`` in the environment (read once, at import) turns every kernel off, e.g. to
compare the two paths or to rule the kernels out when chasing a bug. A Flower app bundle carries
``*.py`` files only: a ClientApp that imports fedcomp from its bundle runs the NumPy paths.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: Kernel modules by short name ("sbc", "threelc"); None where not built or switched off.
_LOADED: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """Whether the kernels may be used at all (``FEDCOMP_NATIVE`` is not ``0``)."""
    return os.environ.get("FEDCOMP_NATIVE", "1").strip() != "0"


def load(name: str) -> ModuleType | None:
    """The kernel module ``fedcomp._native._<name>``, or None when it was not built (no C
    compiler at install time) or the kernels are switched off."""
    if name not in _LOADED:
        module = None
        if enabled():
            try:
                module = importlib.import_module(f"fedcomp._native._{name}")
            except ImportError:
                module = None
        _LOADED[name] = module
    return _LOADED[name]


def status() -> dict[str, bool]:
    """Which kernels are in use, by short name (for benchmarks and bug reports)."""
    return {name: load(name) is not None for name in ("sbc", "threelc")}

"""Optional C kernels for the CPU codec paths, and the switch that turns them off.

The kernels (``fedcomp/_native/*.c``, built by ``setup.py`` as optional extensions when the package
is installed) do in one pass over a tensor what the NumPy paths do in several: they exist for speed
only. Every codec that uses one keeps its NumPy path, and the two give the same bytes: the golden
fixtures and the tests run both.

``FEDCOMP_NATIVE=0`` in the environment (read once, at import) turns every kernel off, e.g. to
compare the two paths or to rule the kernels out when chasing a bug.

A Flower app bundle (FAB) carries ``*.py`` files only. The reference app bundles fedcomp's own
sources, so its ClientApp and ServerApp import a copy of fedcomp without the compiled kernels.
:func:`load` then takes the kernel from the installed fedcomp (an editable install's source tree,
or site-packages) when, and only when, that installation's codec and wire sources (``codecs/*.py``, ``wire/*.py`` and
``_native/*.py``) are byte for byte the ones running: kernels built for other code are never
mixed in. Otherwise the codecs run their NumPy paths.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType

#: Kernel modules by short name ("sbc", "threelc", "wire"); None where not built or switched off.
_LOADED: dict[str, ModuleType | None] = {}
#: Where each loaded kernel came from: "package" (beside this file) or the installed copy's path.
_ORIGIN: dict[str, str] = {}
#: The package sources a kernel must have been built beside to be borrowed by a bundled copy.
_MATCHED = ("codecs", "wire", "_native")


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
                _ORIGIN[name] = "package"
            except ImportError:
                module = _from_installed(name)
        _LOADED[name] = module
    return _LOADED[name]


def status() -> dict[str, bool]:
    """Which kernels are in use, by short name (for benchmarks and bug reports)."""
    return {name: load(name) is not None for name in ("sbc", "threelc", "wire")}


def origin(name: str) -> str | None:
    """Where the kernel ``name`` was loaded from (``"package"``, or the installed fedcomp's
    folder it was borrowed from), None when it is not in use."""
    return _ORIGIN.get(name) if load(name) is not None else None


# --- a bundled copy borrowing the installed kernels -----------------------------------------------


def _here() -> Path:
    """The running fedcomp package's folder."""
    return Path(__file__).resolve().parent.parent


def _installed_roots() -> list[Path]:
    """Folders of other fedcomp packages this interpreter could have imported: an editable
    install's source tree (setuptools' finder mapping) and ``fedcomp/`` under each ``sys.path``
    entry; the running one excluded."""
    found: list[Path] = []
    for finder in sys.meta_path:
        mapping = getattr(sys.modules.get(getattr(finder, "__module__", "") or ""), "MAPPING", None)
        if isinstance(mapping, dict) and isinstance(mapping.get("fedcomp"), str):
            found.append(Path(mapping["fedcomp"]))
    found += [Path(entry or ".") / "fedcomp" for entry in sys.path if isinstance(entry, str)]
    here, out = _here(), []
    for root in found:
        try:
            resolved = root.resolve()
        except OSError:
            continue
        if resolved != here and resolved not in out and (resolved / "_native").is_dir():
            out.append(resolved)
    return out


def _same_sources(root: Path) -> bool:
    """Whether ``root``'s codec and kernel-loader sources are exactly the running ones."""
    here = _here()
    for sub in _MATCHED:
        mine = sorted(p.name for p in (here / sub).glob("*.py"))
        theirs = sorted(p.name for p in (root / sub).glob("*.py"))
        if mine != theirs:
            return False
        for name in mine:
            if (here / sub / name).read_bytes() != (root / sub / name).read_bytes():
                return False
    return True


def _from_installed(name: str) -> ModuleType | None:
    """The kernel ``name`` built in an installed fedcomp whose codec sources equal the running
    ones (this copy being a bundle without compiled files), or None."""
    for root in _installed_roots():
        built = [root / "_native" / f"_{name}{suffix}" for suffix in EXTENSION_SUFFIXES]
        path = next((p for p in built if p.is_file()), None)
        try:
            if path is None or not _same_sources(root):
                continue
            spec = importlib.util.spec_from_file_location(f"fedcomp._native._{name}", path)
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (OSError, ImportError):
            continue
        sys.modules[spec.name] = module
        _ORIGIN[name] = str(root)
        return module
    return None

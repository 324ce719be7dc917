"""The package's layers: imports only go down, and no two packages import each other.

    errors (0) < wire + v1 (1) < codecs (2) < methods (3) < flower (4) < app (5) < top (6)
    net (1): a utility layer beside wire; imports only ``fedcomp.errors`` and itself, and only
    ``methods``, ``flower``, ``app`` (and the top group) import it
    _native (0): the optional C kernels' loader; imports nothing of fedcomp, only ``wire`` and
    ``codecs`` (and the top group) import it

The top group (``bench``, ``testing``, ``deploy.py``, ``cli.py``, ``fuzz.py``, ``__init__.py``, ``__main__.py``) may import
anything; no library layer may import it. A module may import its own layer and strictly lower
ranks. Every ``fedcomp`` import counts: module-level, function-level, under ``TYPE_CHECKING``,
relative, and ``importlib.import_module("fedcomp...")`` with a literal name; ``from fedcomp.x
import y`` is an import of the submodule ``fedcomp.x.y`` when that module exists.

Only :mod:`ast` is used (the files are parsed, not imported). ``python3 tests/test_layers.py
[ROOT]`` prints the numbers: modules per package, import edges, the longest import chain.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fedcomp"

#: The layer of each first-level name under ``fedcomp`` (a subpackage or a top-level module).
LAYER_OF = {
    "errors": "errors",
    "v1": "wire",
    "wire": "wire",
    "net": "net",
    "_native": "native",
    "codecs": "codecs",
    "methods": "methods",
    "flower": "flower",
    "app": "app",
    "bench": "top",
    "testing": "top",
    "deploy": "top",
    "cli": "top",
    "fuzz": "top",
    "__init__": "top",
    "__main__": "top",
}
RANK = {"errors": 0, "wire": 1, "net": 1, "native": 0, "codecs": 2, "methods": 3, "flower": 4, "app": 5, "top": 6}
#: Layers with a narrower allowance than their rank: the only layers they may import.
ONLY = {"net": {"errors", "net"}, "native": {"native"}}
#: Layers that only some higher layers may import: those layers (net is no business of codecs).
IMPORTED_BY = {"net": {"methods", "flower", "app", "top"}, "native": {"wire", "codecs", "top"}}


@dataclass(frozen=True)
class Edge:
    """``path`` (module ``src``) imports module ``dst`` at ``line``."""

    src: str
    path: str
    dst: str
    line: int

    def __str__(self) -> str:
        return f"{self.path} -> {self.dst}  (line {self.line})"


# --- reading the tree -----------------------------------------------------------------------------


def module_name(rel: Path) -> str:
    """``fedcomp/x/a.py`` -> ``fedcomp.x.a``; ``fedcomp/x/__init__.py`` -> ``fedcomp.x``."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_modules(root: Path) -> dict[str, tuple[str, str]]:
    """Every module under ``root/fedcomp``: name -> (path relative to root, source)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        out[module_name(rel)] = (rel.as_posix(), path.read_text(encoding="utf-8"))
    return out


def imports_of(name: str, path: str, source: str, known: set[str]) -> list[Edge]:
    """The ``fedcomp`` modules that the module ``name`` (file ``path``) imports, anywhere in it."""
    is_package = path.endswith("__init__.py")
    package = name if is_package else name.rpartition(".")[0]
    edges = []

    def add(target: str, line: int) -> None:
        if (target == PACKAGE or target.startswith(PACKAGE + ".")) and target != name:
            edges.append(Edge(name, path, target, line))

    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, up level - 1
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value, node.lineno)
    return list(dict.fromkeys(edges))  # one edge per line and module (``from m import a, b``)


def collect_edges(modules: Mapping[str, tuple[str, str]]) -> list[Edge]:
    known = set(modules)
    return [e for name, (path, source) in modules.items() for e in imports_of(name, path, source, known)]


# --- the rules --------------------------------------------------------------------------------------


def package_of(module: str) -> str:
    """The first-level name under ``fedcomp`` (``__init__`` for ``fedcomp`` itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> str:
    return LAYER_OF[package_of(module)]


def unknown_packages(modules: Iterable[str]) -> list[str]:
    return sorted({package_of(m) for m in modules} - set(LAYER_OF))


def upward_edges(edges: Iterable[Edge]) -> list[Edge]:
    """Rule (a): an import of a higher (or same-rank, other) layer, or one that ``ONLY`` or
    ``IMPORTED_BY`` forbids; imports of the top group are rule (b)'s."""
    bad = []
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if dst == "top" or src == dst:
            continue
        if (
            RANK[dst] >= RANK[src]
            or (src in ONLY and dst not in ONLY[src])
            or (dst in IMPORTED_BY and src not in IMPORTED_BY[dst])
        ):
            bad.append(e)
    return bad


def top_edges(edges: Iterable[Edge]) -> list[Edge]:
    """Rule (b): a library layer importing ``bench``, ``testing``, ``deploy`` or ``fedcomp`` itself."""
    return [e for e in edges if layer_of(e.src) != "top" and layer_of(e.dst) == "top"]


def package_graph(edges: Iterable[Edge]) -> dict[tuple[str, str], list[Edge]]:
    """The module edges behind each package-level edge ``(importer, imported)``."""
    graph: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for e in edges:
        a, b = package_of(e.src), package_of(e.dst)
        if a != b:
            graph[a, b].append(e)
    return graph


def package_cycles(edges: Iterable[Edge]) -> list[tuple[str, ...]]:
    """Rule (c): for every package on a cycle, the shortest package cycle through it (breadth-first),
    each cycle once, starting at its smallest package name: ``("app", "codecs")`` is app -> codecs -> app."""
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in package_graph(edges):
        succ[a].add(b)
    found: set[tuple[str, ...]] = set()
    for start in sorted(succ):
        parent: dict[str, str] = {}
        queue = [start]
        while queue and start not in parent:
            node = queue.pop(0)
            for nxt in sorted(succ[node]):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        if start in parent:  # walk back from start to start
            path = [start]
            while parent[path[-1]] != start:
                path.append(parent[path[-1]])
            cycle = path[::-1]  # start ... in import order, then back to start
            i = cycle.index(min(cycle))
            found.add(tuple(cycle[i:] + cycle[:i]))
    return sorted(found)


def _cycle_report(cycle: tuple[str, ...], edges: Iterable[Edge]) -> str:
    graph = package_graph(edges)
    lines = [f"packages importing each other: {' -> '.join([*cycle, cycle[0]])}"]
    for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
        hop = sorted(graph[a, b], key=lambda e: (e.path, e.dst, e.line))
        more = f"  (+{len(hop) - 3} more)" if len(hop) > 3 else ""
        lines += [f"  {e}" for e in hop[:3]]
        lines[-1] += more
    return "\n".join(lines)


def _report(title: str, edges: Iterable[Edge]) -> str:
    return title + "\n" + "\n".join(f"  {e}" for e in sorted(edges, key=lambda e: (e.path, e.dst, e.line)))


# --- the tests on the real tree -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, tuple[str, str]], list[Edge]]:
    modules = read_modules(ROOT)
    return modules, collect_edges(modules)


def test_every_package_has_a_layer(tree) -> None:
    modules, _ = tree
    assert not unknown_packages(modules), (
        f"fedcomp packages with no layer: {unknown_packages(modules)}; add them to LAYER_OF in {Path(__file__).name}"
    )


def test_no_layer_imports_a_higher_one(tree) -> None:
    _, edges = tree
    bad = upward_edges(edges)
    assert not bad, _report("imports of a higher layer (errors < wire/v1, net < codecs < methods < flower < app):", bad)


def test_no_library_layer_imports_the_top_group(tree) -> None:
    _, edges = tree
    bad = top_edges(edges)
    assert not bad, _report("library modules importing bench/testing/deploy/fedcomp:", bad)


def test_no_import_cycle_between_packages(tree) -> None:
    _, edges = tree
    cycles = package_cycles(edges)
    assert not cycles, "\n".join(_cycle_report(c, edges) for c in cycles)


# --- the checker itself, on synthetic trees ------------------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


BASE = {
    "fedcomp/__init__.py": "from fedcomp.codecs import dense\n",
    "fedcomp/errors.py": "",
    "fedcomp/codecs/__init__.py": "from .dense import Dense\n",
    "fedcomp/codecs/dense.py": "from fedcomp.errors import PayloadError\nclass Dense: ...\n",
    "fedcomp/app/__init__.py": "",
    "fedcomp/app/apps.py": "from fedcomp.codecs.dense import Dense\n",
    "fedcomp/net/__init__.py": "",
    "fedcomp/net/links.py": "from fedcomp import errors\n",
    "fedcomp/bench/__init__.py": "import fedcomp.app.apps\n",
}


def _check(tmp_path: Path, extra: Mapping[str, str]) -> tuple[list[Edge], list[Edge], list[list[Edge]]]:
    edges = collect_edges(read_modules(_write(tmp_path, {**BASE, **extra})))
    return upward_edges(edges), top_edges(edges), package_cycles(edges)


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    assert _check(tmp_path, {}) == ([], [], [])


def test_checker_reports_an_upward_edge_inside_a_function(tmp_path: Path) -> None:
    body = "def f():\n    from fedcomp.app import apps\n    return apps\n"
    up, top, cycles = _check(tmp_path, {"fedcomp/codecs/dense.py": body})
    assert [str(e) for e in up] == ["fedcomp/codecs/dense.py -> fedcomp.app.apps  (line 2)"]
    assert top == []
    assert cycles == [("app", "codecs")]
    assert "fedcomp/codecs/dense.py -> fedcomp.app.apps" in _cycle_report(
        cycles[0], collect_edges(read_modules(tmp_path))
    )
    assert "fedcomp/codecs/dense.py -> fedcomp.app.apps" in _report("x", up)


def test_checker_reports_a_cycle_once_in_import_order(tmp_path: Path) -> None:
    extra = {
        "fedcomp/codecs/dense.py": "import fedcomp.net.links\n",
        "fedcomp/net/links.py": "from fedcomp.app import apps\n",
    }
    _, _, cycles = _check(tmp_path, extra)
    assert cycles == [("app", "codecs", "net")]  # app -> codecs -> net -> app
    report = _cycle_report(cycles[0], collect_edges(read_modules(tmp_path)))
    assert report.splitlines() == [
        "packages importing each other: app -> codecs -> net -> app",
        "  fedcomp/app/apps.py -> fedcomp.codecs.dense  (line 1)",
        "  fedcomp/codecs/dense.py -> fedcomp.net.links  (line 1)",
        "  fedcomp/net/links.py -> fedcomp.app.apps  (line 1)",
    ]


def test_checker_sees_type_checking_relative_and_importlib_imports(tmp_path: Path) -> None:
    extra = {
        "fedcomp/codecs/dense.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..app.apps import X\n"
            "import importlib\nm = importlib.import_module('fedcomp.bench')\n"
        ),
        "fedcomp/net/links.py": "from fedcomp.codecs import dense\n",  # net: errors and net only
        "fedcomp/codecs/topk.py": "import fedcomp.net.links\n",  # only methods, flower, app use net
        "fedcomp/app/data.py": "from fedcomp.net import links\n",  # ... like this
    }
    up, top, _ = _check(tmp_path, extra)
    assert {(e.path, e.dst) for e in up} == {
        ("fedcomp/codecs/dense.py", "fedcomp.app.apps"),
        ("fedcomp/net/links.py", "fedcomp.codecs.dense"),
        ("fedcomp/codecs/topk.py", "fedcomp.net.links"),
    }
    assert [(e.path, e.dst) for e in top] == [("fedcomp/codecs/dense.py", "fedcomp.bench")]


def test_checker_reports_the_top_group_and_names_from_the_package_root(tmp_path: Path) -> None:
    extra = {"fedcomp/app/apps.py": "from fedcomp.testing import helper\nfrom fedcomp import VERSION\n"}
    _, top, _ = _check(tmp_path, extra)
    assert sorted(str(e) for e in top) == [
        "fedcomp/app/apps.py -> fedcomp  (line 2)",
        "fedcomp/app/apps.py -> fedcomp.testing  (line 1)",
    ]


def longest_chain(edges: Iterable[Edge]) -> list[str]:
    """The longest chain of imports between distinct modules (exhaustive search; the package is
    small). Raises RecursionError only on absurdly deep trees."""
    graph: dict[str, set[str]] = defaultdict(set)
    for e in edges:
        graph[e.src].add(e.dst)
    best: list[str] = []

    def walk(path: list[str], seen: set[str]) -> None:
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        for nxt in sorted(graph[path[-1]] - seen):
            seen.add(nxt)
            path.append(nxt)
            walk(path, seen)
            path.pop()
            seen.discard(nxt)

    for start in sorted(graph):
        walk([start], {start})
    return best


def main(argv: list[str]) -> int:
    """Prints the numbers for a checkout (default: this one): ``python3 tests/test_layers.py [ROOT]``."""
    root = Path(argv[0]).resolve() if argv else ROOT
    modules = read_modules(root)
    edges = collect_edges(modules)
    pairs = {(e.src, e.dst) for e in edges}
    print(f"{len(modules)} modules under {root / PACKAGE}")
    counts: dict[str, int] = defaultdict(int)
    for m in modules:
        counts[package_of(m)] += 1
    for pkg, n in sorted(counts.items()):
        print(f"  {pkg:<12}{n:>3}  (layer {LAYER_OF.get(pkg, '-')})")
    print(f"import edges (distinct module pairs): {len(pairs)}")
    print(f"package edges: {len({(package_of(a), package_of(b)) for a, b in pairs if package_of(a) != package_of(b)})}")
    chain = longest_chain(Edge(a, "", b, 0) for a, b in pairs)
    print(f"longest import chain: {len(chain) - 1} imports, {len(chain)} modules: {' -> '.join(chain)}")
    if not unknown_packages(modules):
        print(f"upward: {len(upward_edges(edges))}, top: {len(top_edges(edges))}, cycles: {len(package_cycles(edges))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

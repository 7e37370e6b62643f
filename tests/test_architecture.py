"""Architecture rules, checked on the source: no import cycle between modules, no module over 600 lines.

Imports are read with ``ast`` (never executed): module-level and function-level ``import`` /
``from ... import``, relative ones resolved against the importing module's package. Imports under
``if TYPE_CHECKING:`` are left out (they never run). ``procs/`` installs as ``dflash_ipc.procs``
(setuptools package-dir), so its files are mapped there.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"dflash_ipc": REPO / "dflash_ipc", "dflash_ipc.procs": REPO / "procs"}
MAX_LINES = 600


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (procs/ as dflash_ipc.procs)."""
    out: dict[str, Path] = {}
    for prefix, root in PACKAGE_DIRS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "dflash_ipc" and name.startswith("dflash_ipc.procs"):
                continue
            out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (an import of ``a.b.c`` counts as an import of the
    longest prefix that is a package module; ``from pkg import sub`` counts ``pkg.sub`` when it
    is a module, else ``pkg``)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        while dotted:
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            hit = resolve(target)
            if hit is not None and hit != name:
                found.add(hit)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    for root in sorted(graph):
        if root in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # shortest path start -> ... -> start inside the component (BFS)
        previous: dict[str, str] = {}
        frontier = [start]
        seen = {start}
        end = None
        while frontier and end is None:
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node] & members):
                    if nxt == start:
                        end = node
                        break
                    if nxt not in seen:
                        seen.add(nxt)
                        previous[nxt] = node
                        nxt_frontier.append(nxt)
                if end is not None:
                    break
            frontier = nxt_frontier
        path = [start]
        node = end
        while node != start:
            path.append(node)
            node = previous[node]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


# --------------------------------------------------------------------------- the checker, checked


def test_cycle_finder_finds_a_planted_cycle_and_nothing_in_a_tree():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_import_reader_resolves_relative_function_level_and_procs_imports(tmp_path):
    pkg = tmp_path / "dflash_ipc" / "data"
    pkg.mkdir(parents=True)
    src = pkg / "corpus.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import tokenizer\n"
        "from ..target.model import build\n"
        "if TYPE_CHECKING:\n"
        "    from dflash_ipc.drafter import loss\n"
        "def f():\n"
        "    import dflash_ipc.procs.target\n"
    )
    modules = {
        m: tmp_path
        for m in (
            "dflash_ipc.data.corpus",
            "dflash_ipc.data.tokenizer",
            "dflash_ipc.target.model",
            "dflash_ipc.drafter.loss",
            "dflash_ipc.procs.target",
            "dflash_ipc.data",
        )
    }
    got = imported_modules("dflash_ipc.data.corpus", src, modules)
    assert got == {"dflash_ipc.data.tokenizer", "dflash_ipc.target.model", "dflash_ipc.procs.target"}


def test_the_graph_covers_the_package_and_procs():
    graph = import_graph()
    assert "dflash_ipc.procs.target" in graph and "dflash_ipc.drafter.core" in graph["dflash_ipc.procs.drafter"]
    assert graph["dflash_ipc.data.corpus"] >= {"dflash_ipc.data.builtin_corpus", "dflash_ipc.data.tokenizer"}
    assert not graph["dflash_ipc.data.tokenizer"] & {"dflash_ipc.data.corpus", "dflash_ipc.data.builtin_corpus"}


# --------------------------------------------------------------------------- the rules


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    text = "\n".join(" -> ".join(c) for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) between modules:\n{text}"


def test_no_module_over_600_lines():
    modules = package_modules()
    too_long = {name: n for name, path in modules.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    text = "\n".join(f"{modules[m].relative_to(REPO)}: {n} lines" for m, n in sorted(too_long.items()))
    assert not too_long, f"{len(too_long)} module(s) over {MAX_LINES} lines:\n{text}"


def test_every_subpackage_is_installed():
    """pyproject lists the packages explicitly (procs/ maps to dflash_ipc.procs): a sub-package left
    out works from an editable checkout and is missing from a wheel."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "dflash_ipc").rglob("__init__.py")}
    on_disk.add("dflash_ipc.procs")
    assert on_disk == listed, f"missing from pyproject: {sorted(on_disk - listed)}; listed but absent: {sorted(listed - on_disk)}"


def test_every_from_import_of_the_package_resolves():
    """Imports inside functions are not checked by the linter; a split that moves a name breaks
    them only when that function runs. Import each module named and look the names up."""
    import importlib

    missing = []
    for path in [*(REPO / "dflash_ipc").rglob("*.py"), *(REPO / "procs").glob("*.py"), *(REPO / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dflash_ipc"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, "names imported but not defined:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- layers point down

#: The pure cores: they never reach up into the process machinery (runtime), operations (ops),
#: benchmarks (bench) or the process shells (procs).
CORE_PACKAGES = ("target", "drafter", "data", "transport", "control")
ABOVE_THE_CORES = ("runtime", "ops", "bench", "procs")
ROLES = ("target", "drafter")
#: What the drafter reads of the target package: the frozen target model's description (its HF
#: configuration and layer ids; its embedding and LM head weights), which the drafter is built on.
#: Nothing of the target's process (core, loop, model, packing) crosses.
TARGET_MODEL_FACTS = {"dflash_ipc.target_spec.hf_config", "dflash_ipc.target_spec.heads"}


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    pairs = ((m, d) for m, deps in graph.items() for d in deps)
    return sorted(f"{m} -> {d}" for m, d in pairs if _subpackage(m) in CORE_PACKAGES and _subpackage(d) in ABOVE_THE_CORES)


def cross_role_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _subpackage(m) in ROLES
        for d in deps
        if _subpackage(d) in ROLES and _subpackage(d) != _subpackage(m) and d not in TARGET_MODEL_FACTS
    )


def test_cores_never_import_the_layers_above_them():
    bad = upward_imports(import_graph())
    assert not bad, "a core imports a layer above it (move what it needs down into a leaf module):\n" + "\n".join(bad)


def test_no_role_imports_another_roles_package():
    bad = cross_role_imports(import_graph())
    assert not bad, "a role imports another role's package (share it through a leaf module, e.g. ledger, node_spec):\n" + "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    bad = []
    for path in [*(REPO / "dflash_ipc").rglob("*.py"), *(REPO / "procs").glob("*.py")]:
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dflash_ipc")):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                bad += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{n}" for n in names]
    assert not bad, "private names imported from another module (make them public where they are defined):\n" + "\n".join(bad)


def test_the_layer_rules_catch_planted_violations():
    graph = {
        "dflash_ipc.target.core": {"dflash_ipc.runtime.nodes", "dflash_ipc.drafter.checkpoint", "dflash_ipc.ledger"},
        "dflash_ipc.drafter.core": {"dflash_ipc.target_spec.hf_config", "dflash_ipc.procs.target"},
        "dflash_ipc.runtime.supervisor": {"dflash_ipc.target.core"},
    }
    assert upward_imports(graph) == [
        "dflash_ipc.drafter.core -> dflash_ipc.procs.target",
        "dflash_ipc.target.core -> dflash_ipc.runtime.nodes",
    ]
    assert cross_role_imports(graph) == ["dflash_ipc.target.core -> dflash_ipc.drafter.checkpoint"]

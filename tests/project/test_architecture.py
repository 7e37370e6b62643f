"""Architecture rules, checked on the source: no import cycle between modules nor between packages,
packages import only the layers below them, no private name crosses modules, the drafter's rooms point down,
the package's top holds only packages, click lives in ``cli/`` alone, the process shells only wire, docs/DESIGN.md's
map names every package and only packages, and no function runs over 100 lines. Modules have no length cap: a
module holds one idea, however long.

Imports are read with ``ast`` (never executed): module-level and function-level ``import`` /
``from ... import``, relative ones resolved against the importing module's package. Imports under
``if TYPE_CHECKING:`` are left out (they never run). ``procs/`` installs as ``dflash_ipc.procs``
(setuptools package-dir), so its files are mapped there.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"dflash_ipc": REPO / "dflash_ipc", "dflash_ipc.procs": REPO / "procs"}


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
            "dflash_ipc.drafter.loss.objective",
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


def test_the_package_top_holds_only_its_face_and_packages():
    """Every module has a named home: ``dflash_ipc/`` itself holds ``__init__.py`` and sub-packages, nothing loose."""
    loose = sorted(p.name for p in (REPO / "dflash_ipc").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules loose at dflash_ipc/'s top (give each its package): {loose}"


def test_every_click_command_lives_in_cli():
    """One precedent for a new command: click is imported under ``dflash_ipc/cli/`` and nowhere else."""
    found = []
    for name, path in package_modules().items():
        if name.startswith("dflash_ipc.cli"):
            continue
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m == "click" or m.startswith("click.") for m in imported):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, "click imported outside dflash_ipc/cli/:\n" + "\n".join(found)


def test_the_process_shells_only_wire():
    """``procs/<role>.py`` starts one OS process: its ``run_<role>_process`` wires a core, rings, a data plane and
    a loop together. A class there would be policy, which belongs to the role's core or loop, or the runtime."""
    bad = []
    for path in sorted((REPO / "procs").glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        bad += [f"{path.name}:{n.lineno}: class {n.name}" for n in tree.body if isinstance(n, ast.ClassDef)]
        entry = f"run_{path.stem}_process"
        if not any(isinstance(n, ast.FunctionDef) and n.name == entry for n in tree.body):
            bad.append(f"{path.name}: no {entry}")
    assert not bad, "process shells only wire:\n" + "\n".join(bad)


def design_map_packages(design: str) -> set[str]:
    """The packages DESIGN.md's map names: each line of the block under "## Packages by role" that starts with
    ``name/`` names one (``drafter/model`` when indented under ``drafter/``)."""
    block = design.split("## Packages by role", 1)[1].split("```", 2)[1]
    names, top = set(), ""
    for line in block.splitlines():
        m = re.match(r"( +)([a-z_]+)/", line)
        if m is None:
            continue
        if len(m.group(1)) == 1:
            top = m.group(2)
            names.add(top)
        else:
            names.add(f"{top}/{m.group(2)}")
    return names


def test_the_design_map_names_every_package_and_only_packages():
    assert design_map_packages("## Packages by role\n```\n a/   x\n   b/  y\n c/ z ─ w/\n```\n") == {"a", "a/b", "c"}
    mapped = design_map_packages((REPO / "docs" / "DESIGN.md").read_text())
    on_disk = {p.parent.relative_to(REPO / "dflash_ipc").as_posix() for p in (REPO / "dflash_ipc").rglob("__init__.py")} - {"."}
    on_disk.add("procs")
    assert mapped == on_disk, f"docs/DESIGN.md's map lacks {sorted(on_disk - mapped)}; names no package {sorted(mapped - on_disk)}"


# the test rooms that are not one package: whole `up` process groups, the fault suite, the repository itself
CROSS_PACKAGE_TEST_ROOMS = frozenset({"end_to_end", "faults", "project"})


def test_tests_mirror_the_packages():
    """A test sits in the room of the package it tests (tests/<package>/), or in one of the cross-package rooms;
    nothing at tests/'s top but the shared fixtures and harnesses."""
    rooms = {p.parent.name for p in (REPO / "dflash_ipc").glob("*/__init__.py")} | CROSS_PACKAGE_TEST_ROOMS
    misplaced = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        room = path.relative_to(REPO / "tests").parts
        if len(room) != 2 or room[0] not in rooms:
            misplaced.append(path.relative_to(REPO).as_posix())
    assert not misplaced, f"tests outside tests/<package>/ or {sorted(CROSS_PACKAGE_TEST_ROOMS)}: {misplaced}"


def test_a_test_imports_another_rooms_test_module_by_its_room():
    """pytest puts a test's own folder on sys.path when it collects the test: a bare ``from test_x import`` of
    another room's module resolves only when that room happened to be collected first (``pytest tests/drafter``
    alone fails). Another room's module is imported as ``room.test_x``."""
    bare = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("test_"):
                if not (path.parent / f"{node.module}.py").exists():
                    bare.append(f"{path.relative_to(REPO).as_posix()}:{node.lineno} from {node.module}")
    assert not bare, f"import these through their room (e.g. from drafter.test_dflash_loss import ...): {bare}"


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

#: The layers, lowest first. A unit is a sub-package (``dflash_ipc.data``; ``dflash_ipc`` itself is the
#: package's face); ``dflash_ipc.procs`` is the process shells. A unit imports only units of
#: the layers below its own; within one layer only the leaves import each other (the package-level
#: cycle test keeps that acyclic). ``target`` and ``drafter`` share a layer, so neither role imports
#: the other: what both read of the frozen target lives in the leaf ``target_spec``.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (name, frozenset(units))
    for name, units in (
        (
            "leaves",
            {
                "dflash_ipc",
                "assets",
                "config",
                "families",
                "platform",
                "rundir",
                "target_spec",
            },
        ),  # fmt: skip
        ("control", {"control"}),
        ("transport", {"transport"}),
        ("data", {"data"}),
        ("roles", {"target", "drafter"}),
        ("eval", {"eval"}),
        ("datagen", {"datagen"}),
        ("ops", {"ops"}),
        ("runtime", {"runtime"}),
        ("bench", {"bench"}),
        ("procs", {"procs"}),
        ("cli", {"cli"}),
    )
)
LEAF_LAYER = "leaves"
ROLES = ("target", "drafter")


def unit_of(module: str) -> str:
    """``dflash_ipc.data.corpus`` -> ``data``; ``dflash_ipc.rundir.ledger`` -> ``rundir``; ``dflash_ipc`` -> ``dflash_ipc``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed onto units: ``a -> b`` when some module of ``a`` imports one of ``b``."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(unit_of(module), set()).update(unit_of(d) for d in deps)
    for unit, deps in list(out.items()):
        deps.discard(unit)
        for dep in deps:
            out.setdefault(dep, set())
    return out


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every module import that does not point to a lower layer (or, for leaves, to another leaf),
    and every unit that no layer names."""
    rank = {unit: (i, layer) for i, (layer, units) in enumerate(LAYERS) for unit in units}
    unplaced = sorted({unit_of(m) for m in graph} - rank.keys())
    bad = [f"{unit}: in no layer (add it to LAYERS in tests/project/test_architecture.py)" for unit in unplaced]
    for module, deps in sorted(graph.items()):
        src = unit_of(module)
        for dep in sorted(deps):
            dst = unit_of(dep)
            if src == dst or src not in rank or dst not in rank:
                continue
            (i, layer), (j, dst_layer) = rank[src], rank[dst]
            if j > i or (j == i and layer != LEAF_LAYER):
                bad.append(f"{module} -> {dep} ({layer} -> {dst_layer})")
    return bad


def cross_role_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() if unit_of(m) in ROLES for d in deps if unit_of(d) in ROLES and unit_of(d) != unit_of(m)
    )


def test_no_import_cycles_between_packages():
    """Module-level acyclicity still lets data.a -> eval.b -> data.c close a loop between packages."""
    cycles = import_cycles(package_graph(import_graph()))
    text = "\n".join(" -> ".join(c) for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) between packages:\n{text}"


def test_every_import_points_to_a_lower_layer():
    bad = layer_violations(import_graph())
    order = " < ".join(layer for layer, _ in LAYERS)
    assert not bad, f"imports that do not point down ({order}):\n" + "\n".join(bad)


def test_data_imports_neither_eval_nor_a_role():
    """The core data package serves both roles and eval; what it needs of the target is in target_spec."""
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if unit_of(m) == "data" for d in deps if unit_of(d) in {"eval", *ROLES})
    assert not bad, "data imports a layer built on it:\n" + "\n".join(bad)


def test_no_role_imports_another_roles_package():
    bad = cross_role_imports(import_graph())
    assert not bad, "a role imports another role's package (share it through a leaf, e.g. target_spec, rundir):\n" + "\n".join(bad)


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
        "dflash_ipc.target.core": {"dflash_ipc.runtime.nodes", "dflash_ipc.drafter.checkpoint.store", "dflash_ipc.rundir.ledger"},
        "dflash_ipc.drafter.core": {"dflash_ipc.target_spec.hf_config", "dflash_ipc.procs.target"},
        "dflash_ipc.data.tokenizer": {"dflash_ipc.eval.target_lm", "dflash_ipc.target_spec.hf_config"},
        "dflash_ipc.eval.target_lm": {"dflash_ipc.data.readers"},
        "dflash_ipc.runtime.supervisor": {"dflash_ipc.target.core"},
        "dflash_ipc.config": {"dflash_ipc.rundir.fsutil"},
        "dflash_ipc.gadget": set(),
    }
    assert layer_violations(graph) == [
        "gadget: in no layer (add it to LAYERS in tests/project/test_architecture.py)",
        "dflash_ipc.data.tokenizer -> dflash_ipc.eval.target_lm (data -> eval)",
        "dflash_ipc.drafter.core -> dflash_ipc.procs.target (roles -> procs)",
        "dflash_ipc.target.core -> dflash_ipc.drafter.checkpoint.store (roles -> roles)",
        "dflash_ipc.target.core -> dflash_ipc.runtime.nodes (roles -> runtime)",
    ]
    assert cross_role_imports(graph) == ["dflash_ipc.target.core -> dflash_ipc.drafter.checkpoint.store"]
    units = package_graph(graph)
    assert units["data"] == {"eval", "target_spec"} and units["eval"] == {"data"}
    assert import_cycles(units) == [["data", "eval", "data"], ["runtime", "target", "runtime"]]


#: The drafter's rooms, lowest first: a module of one imports only its own room and those below it; the
#: core and the loop (``dflash_ipc.drafter.core``, ``.loop``) sit above them all.
DRAFTER_ROOMS = ("model", "loss", "checkpoint", "training", "export")


def drafter_room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import between the drafter's modules that points to a higher room (or to the core and loop)."""

    def rank(module: str) -> int:
        room = module.split(".")[2]
        return DRAFTER_ROOMS.index(room) if room in DRAFTER_ROOMS else len(DRAFTER_ROOMS)

    inside = [m for m in graph if m.startswith("dflash_ipc.drafter.")]
    return sorted(f"{m} -> {d}" for m in inside for d in graph[m] if d.startswith("dflash_ipc.drafter.") and rank(d) > rank(m))


def test_the_drafters_rooms_point_down():
    planted = {
        "dflash_ipc.drafter.model.build": {"dflash_ipc.drafter.export.layout"},
        "dflash_ipc.drafter.core": {"dflash_ipc.drafter.loop"},
    }
    assert drafter_room_violations(planted) == ["dflash_ipc.drafter.model.build -> dflash_ipc.drafter.export.layout"]
    bad = drafter_room_violations(import_graph())
    order = " < ".join([*DRAFTER_ROOMS, "core/loop"])
    assert not bad, f"drafter imports that do not point down ({order}):\n" + "\n".join(bad)


# --------------------------------------------------------------------------- functions stay short

MAX_FUNCTION_LINES = 100


def long_functions(source: str, max_lines: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function longer than ``max_lines``, nested ones
    included; the length runs from the ``def`` line to the last line of the body."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > max_lines:
                    found.append((name, child.lineno, n))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_length_rule_counts_def_to_last_line():
    def block(indent: int, n: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(n))

    hundred = "def f():\n" + block(4, 99)
    assert long_functions(hundred) == []
    assert long_functions(hundred + "    y = 0\n") == [("f", 1, 101)]
    nested = "class C:\n    def g(self):\n        def h():\n" + block(12, 99) + "        return h\n"
    assert [(name, n) for name, _, n in long_functions(nested)] == [("C.g", 102)]
    assert [(name, n) for name, _, n in long_functions(nested, max_lines=99)] == [("C.g", 102), ("C.g.h", 100)]


def test_no_function_over_100_lines():
    modules = package_modules()
    too_long = [
        f"{path.relative_to(REPO)}:{line}: {name} ({n} lines)"
        for path in sorted(set(modules.values()))
        for name, line, n in long_functions(path.read_text())
    ]
    text = "\n".join(too_long)
    assert not too_long, f"{len(too_long)} function(s) over {MAX_FUNCTION_LINES} lines (split them into named steps):\n{text}"


def test_every_package_module_is_tracked_by_git():
    """A module git ignores (a .gitignore pattern that also matches a package folder) is missing from every
    clone: its importers fail there and nowhere else."""
    import subprocess

    tracked = set(subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0"))
    untracked = [str(path.relative_to(REPO)) for path in package_modules().values() if str(path.relative_to(REPO)) not in tracked]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "dflash_ipc/data/new.py", "dflash_ipc/models/new.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert not untracked, f"package modules git does not track (git add them, or fix the .gitignore rule): {untracked}"
    assert ignored.stdout == "", f"a .gitignore rule matches inside the package: {ignored.stdout}"

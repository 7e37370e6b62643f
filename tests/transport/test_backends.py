"""The ring backends' traits are declared once (``config/transport.py``'s ``BACKENDS``) and read everywhere: each
row names a module that makes its rings, the config's choices and the descriptor's parts follow the table, and no
module outside the benchmarks compares backend names."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from dflash_ipc.config.transport import BACKENDS, TransportConfig
from dflash_ipc.control.ring_descriptor import PARTS
from dflash_ipc.transport.factory import backend_module

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_ipc"


def test_every_row_names_a_module_that_makes_its_rings():
    for name, backend in BACKENDS.items():
        module = backend_module(name)
        assert callable(module.create_producer) and callable(module.open_consumer), name
        made = {
            getattr(cls, "backend", None) for cls in vars(module).values() if isinstance(cls, type) and cls.__module__ == module.__name__
        }
        assert name in made, f"{backend.module} has no ring class whose backend is {name!r}"
        assert backend.descriptor_parts and set(backend.descriptor_parts) <= set(PARTS), name


def test_the_config_offers_auto_and_every_backend_of_the_table():
    assert typing.get_args(typing.get_type_hints(TransportConfig)["backend"]) == ("auto", *BACKENDS)


def backend_name_comparisons(source: str) -> list[int]:
    """Lines comparing something with a ring backend's name (``x.backend == "cuda-ipc"``, ``b in ("cpu-shm", ...)``).
    "nccl" is left out: it is torch.distributed's backend too, which the drafters' process group compares."""
    names = set(BACKENDS) - {"nccl"}
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    hits.append(node.lineno)
                    break
    return hits


def test_no_module_outside_the_benchmarks_compares_backend_names():
    assert backend_name_comparisons('if ring.backend == "cuda-ipc":\n    pass\nok = b in ("cpu-shm", "x")\n') == [1, 3]
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "bench" not in path.relative_to(PACKAGE).parts
        for line in backend_name_comparisons(path.read_text())
    ]
    assert not found, "read the backend's traits from config.transport.BACKENDS instead:\n" + "\n".join(found)

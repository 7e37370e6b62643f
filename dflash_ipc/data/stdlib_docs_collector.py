"""Collect the docstrings of the standard library; prints one JSON document on stdout.

Run by :func:`dflash_ipc.data.builtin_corpus.stdlib_doc_entries` as a script in a fresh isolated
interpreter (``python -I -S -X utf8 <this file>``: no site-packages, no environment variables,
nothing prepended to ``sys.path``), so importing ~300 modules has no side effects on the caller
and the result does not depend on what the caller imported, patched or installed (a
site-packages backport shadowing a stdlib name cannot leak in). It is run by path rather than
with ``-m`` because ``-m`` needs the package importable, i.e. site-packages or the source tree
on ``sys.path``, which is what the isolation is for. Only the standard library is imported here.

Output: ``{"python": sys.version, "entries": [[module, dotted name, kind, doc], ...]}`` with
kind one of module | class | function | method, docs cleaned with :func:`inspect.cleandoc`.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import sys
import warnings

SKIP = {
    "antigravity", "this", "idlelib", "idle", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "distutils",
    "ensurepip", "venv", "readline", "rlcompleter", "site", "sitecustomize", "usercustomize", "__main__",
    "__hello__", "__phello__", "pydoc_data", "msilib", "winreg", "winsound", "msvcrt", "nt", "_winapi",
    "xxsubtype", "xxlimited", "xxlimited_35", "ossaudiodev", "nis", "spwd", "crypt", "curses", "webbrowser",
}  # fmt: skip
EXTRA = [
    "collections.abc", "concurrent.futures", "email.message", "email.utils", "http.client", "http.server",
    "importlib.metadata", "importlib.resources", "json.decoder", "json.encoder", "logging.handlers", "os.path",
    "unittest.mock", "urllib.parse", "urllib.request", "xml.etree.ElementTree",
]  # fmt: skip


def _clean(doc: object) -> str | None:
    if not isinstance(doc, str):
        return None
    doc = inspect.cleandoc(doc).strip()
    if len(doc) < 24 or " at 0x" in doc:
        return None
    return doc


def _class_entries(module: str, qualname: str, cls: type) -> list[list[str]]:
    out = []
    cls_vars = vars(cls)
    for name in sorted(cls_vars):
        member = cls_vars[name]
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if not (inspect.isroutine(member) or isinstance(member, property)):
            continue
        doc = _clean(getattr(member, "__doc__", None))
        if doc:
            out.append([module, f"{qualname}.{name}", "method", doc])
    return out


def _module_entries(name: str) -> list[list[str]]:
    try:
        mod = importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - any module that cannot import here is left out
        return []
    owners = {name, "_" + name.rsplit(".", 1)[-1]}
    if name == "os":
        owners.add("posix")
    out = []
    doc = _clean(getattr(mod, "__doc__", None))
    if doc:
        out.append([name, name, "module", doc])
    members = vars(mod)
    for attr in sorted(members):
        obj = members[attr]
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) not in owners:
            continue
        doc = _clean(getattr(obj, "__doc__", None))
        if doc:
            out.append([name, f"{name}.{attr}", "class" if inspect.isclass(obj) else "function", doc])
        if inspect.isclass(obj):
            out += _class_entries(name, f"{name}.{attr}", obj)
    return out


def collect() -> list[list[str]]:
    """``[module, dotted name, kind, doc]`` of every documented public stdlib object, by module."""
    names = sorted({n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP} | set(EXTRA))
    out = []
    for name in names:
        out += _module_entries(name)
    return out


def main() -> None:
    warnings.simplefilter("ignore")
    real_stdout = sys.stdout
    # Modules that print on import must not corrupt the JSON document.
    sys.stdout = io.StringIO()
    sys.stderr = io.StringIO()
    try:
        entries = collect()
    finally:
        sys.stdout = real_stdout
    json.dump({"python": sys.version, "entries": entries}, real_stdout)


if __name__ == "__main__":
    main()

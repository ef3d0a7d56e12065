"""The package's layers import one way, and no two files (or folders) import each other.

    benchmark -> server, train -> scheduler -> spec -> model_executor -> models -> layers,
    sampling -> mem_cache, constrained, distributed -> kernels -> the floor

A folder may import itself and the folders of lower rank, never one of equal or higher rank.
The floor (`core`, `config`, `messages`, `device`, `sampling_params`) imports no folder when it
runs (annotations may name a folder's types). The entry points (`engine`, `cli`, `__main__`)
sit on top. Checked on the source, every import statement (lazy ones inside functions and
relative ones included), so a new upward import or cycle fails here at once.
"""

from __future__ import annotations

import ast
import os

import eagleserve

ROOT = os.path.dirname(eagleserve.__file__)
RANK = {
    "kernels": 0,
    "distributed": 1,
    "mem_cache": 1,
    "constrained": 1,
    "layers": 2,
    "sampling": 2,
    "models": 3,
    "model_executor": 4,
    "spec": 5,
    "scheduler": 6,
    "train": 7,
    "server": 7,
    "benchmark": 8,  # a client of a running server (it reads data sets through train)
}
FLOOR = {"core", "config", "messages", "device", "sampling_params"}
NOT_CODE = {"assets", "__pycache__"}


def typing_only_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


def imports_of(path: str, package: str = "", runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in the file; relative ones resolved against `package` (the
    file's own package, dotted); `runtime_only` skips `if TYPE_CHECKING:` ones. `from a import b`
    gives `a.b` (b may be a module)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    skip = typing_only_nodes(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.extend((node.lineno, f"{base}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


def modules(root: str, name: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py file of the package at `root` named `name`."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in NOT_CODE]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                mod = ".".join([name, *rel]).removesuffix(".__init__")
                out[mod] = os.path.join(dirpath, f)
    return out


def import_graph(root: str, name: str) -> dict[str, set[str]]:
    """File-level import graph (module -> modules it imports when it runs, lazy imports included);
    the package's own `__init__` is no node (it re-exports lazily)."""
    mods = modules(root, name)
    graph: dict[str, set[str]] = {m: set() for m in mods if m != name}
    for mod in graph:
        path = mods[mod]
        pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for _, target in imports_of(path, pkg, runtime_only=True):
            while target and target not in mods:  # `from a.b import Name` -> module a.b
                target = target.rpartition(".")[0]
            if target and target != name and target != mod:
                graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for src, targets in graph.items():
        a = src.split(".")
        for t in targets:
            b = t.split(".")
            if len(a) > 2 and len(b) > 2 and a[1] != b[1]:
                folders.setdefault(a[1], set()).add(b[1])
    return folders


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "eagleserve" or len(parts) < 3:
        return None
    return parts[1] if os.path.isdir(os.path.join(ROOT, parts[1])) else None


def upward_imports() -> list[str]:
    bad = []
    for mod, path in modules(ROOT, "eagleserve").items():
        own = layer_of(mod)
        if own is None:
            continue
        pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for line, target in imports_of(path, pkg):
            other = layer_of(target)
            if other in RANK and other != own and RANK[other] >= RANK[own]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}")
    return bad


def test_every_folder_has_a_layer() -> None:
    folders = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))}
    assert folders - NOT_CODE - set(RANK) == set()


def test_no_layer_imports_upward() -> None:
    assert upward_imports() == []


def test_no_import_cycle_between_files_or_folders() -> None:
    graph = import_graph(ROOT, "eagleserve")
    assert cycles(graph) == []
    assert cycles(folder_graph(graph)) == []


def test_floor_imports_no_layer() -> None:
    """Annotations may name a layer's types; running code may not depend on a layer."""
    bad = []
    for name in FLOOR:
        path = os.path.join(ROOT, f"{name}.py")
        for line, module in imports_of(path, "eagleserve", runtime_only=True):
            if layer_of(module) is not None:
                bad.append(f"{name}.py:{line} imports {module}")
    assert bad == []


def test_the_check_sees_an_upward_import(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "m.py")
    with open(path, "w") as f:
        f.write("def f():\n    from eagleserve.scheduler.scheduler import Scheduler\n")
    assert imports_of(path) == [(2, "eagleserve.scheduler.scheduler.Scheduler")]


def test_the_check_sees_a_lazy_and_a_relative_cycle(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "pkg")
    os.makedirs(os.path.join(root, "sub"))
    files = {
        "__init__.py": "",
        "sub/__init__.py": "",
        "sub/a.py": "def f():\n    from pkg.b import g\n",  # lazy
        "b.py": "from .sub.a import f\nfrom pkg.c import h\n",  # relative
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import g\n",
    }
    for name, text in files.items():
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    graph = import_graph(root, "pkg")
    assert cycles(graph) == [["pkg.b", "pkg.sub.a"]]  # c's import for annotations is no edge

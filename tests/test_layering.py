"""The package's layers import one way: server -> scheduler -> model + spec -> kernels.

A module may import from its own layer and the layers below it, and from the shared nouns
(`core`, `config`, `messages`, `device`); never upward. Checked on the source (every import
statement, lazy ones inside functions included), so a new upward import fails here at once.
"""

from __future__ import annotations

import ast
import os

import eagleserve

ROOT = os.path.dirname(eagleserve.__file__)
# Rank of each layer: a module may import modules of equal or lower rank.
RANK = {"kernels": 0, "model": 1, "spec": 2, "scheduler": 3, "train": 3, "server": 4}
SHARED = {"core", "config", "messages", "device"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "eagleserve" or len(parts) < 2:
        return None
    return parts[1]


def imports_of(path: str, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every absolute import; `runtime_only` skips `if TYPE_CHECKING:` ones."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if runtime_only and id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


def upward_imports() -> list[str]:
    bad = []
    for layer, rank in RANK.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, layer)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                for line, module in imports_of(path):
                    target = layer_of(module)
                    if target in RANK and RANK[target] > rank:
                        bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
    return bad


def test_no_layer_imports_upward() -> None:
    assert upward_imports() == []


def test_shared_nouns_import_no_layer() -> None:
    """Annotations may name a layer's types; running code may not depend on a layer."""
    bad = []
    for name in SHARED:
        path = os.path.join(ROOT, f"{name}.py")
        for line, module in imports_of(path, runtime_only=True):
            if layer_of(module) in RANK:
                bad.append(f"{name}.py:{line} imports {module}")
    assert bad == []


def test_the_check_sees_an_upward_import(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "m.py")
    with open(path, "w") as f:
        f.write("def f():\n    from eagleserve.scheduler.scheduler import Scheduler\n")
    assert imports_of(path) == [(2, "eagleserve.scheduler.scheduler")]

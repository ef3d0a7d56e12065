"""Device-agnostic code: `torch.cuda` appears only in eagleserve/device.py."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "eagleserve"
PATTERN = re.compile(r"torch\s*\.\s*cuda\b|from\s+torch\s+import\s+cuda\b")


def test_torch_cuda_only_in_device_module() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "device.py" and path.parent == ROOT:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r"`[^`]*`", "", line.split("#", 1)[0])  # prose mentions don't count
            if PATTERN.search(code):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "torch.cuda outside eagleserve/device.py:\n" + "\n".join(offenders)


def test_pattern_catches_a_use() -> None:
    assert PATTERN.search("x = torch.cuda.Event()")
    assert PATTERN.search("from torch import cuda")
    assert not PATTERN.search("torch.get_device_module(device)")

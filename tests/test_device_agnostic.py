"""Device-agnostic code: `torch.cuda` appears only in eagleserve/device.py."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "eagleserve"
PATTERN = re.compile(r"torch\s*\.\s*cuda\b|from\s+torch\s+import\s+cuda\b")


def _sources(skip: tuple[str, ...]) -> list[tuple[str, str]]:
    """(path relative to eagleserve/, text) of every module but those under `skip` prefixes."""
    return [(rel, path.read_text()) for path in sorted(ROOT.rglob("*.py"))
            if not (rel := path.relative_to(ROOT).as_posix()).startswith(skip)]  # fmt: skip


def test_torch_cuda_only_in_device_module() -> None:
    offenders = []
    for rel, text in _sources(("device.py",)):
        for lineno, line in enumerate(text.splitlines(), 1):
            code = re.sub(r"`[^`]*`", "", line.split("#", 1)[0])  # prose mentions don't count
            if PATTERN.search(code):
                offenders.append(f"eagleserve/{rel}:{lineno}: {line.strip()}")
    assert not offenders, "torch.cuda outside eagleserve/device.py:\n" + "\n".join(offenders)


def test_pattern_catches_a_use() -> None:
    assert PATTERN.search("x = torch.cuda.Event()")
    assert PATTERN.search("from torch import cuda")
    assert not PATTERN.search("torch.get_device_module(device)")


# `torch.tensor(..., device=...)` made on an accelerator is a synchronous copy: the host waits
# for everything queued on the stream, the forward in flight included; so is a host tensor's
# plain `.to(device)` (pageable memory). Serving code uses `device.tensor_to` / `host_to` (a
# pinned copy queued behind that work); start-up and training may wait.
SYNC_TENSOR = re.compile(r"torch\s*\.\s*tensor\((?:[^()]|\([^()]*\))*?\bdevice\s*=", re.S)
SYNC_COPY = re.compile(r"\.to\(\s*(?:self\.)?(?:device|dev)\s*\)")
MAY_WAIT = ("device.py", "spec/cost_model.py", "spec/head_loader.py", "train/")


def test_serving_code_makes_no_synchronous_device_tensors() -> None:
    offenders = []
    for rel, text in _sources(MAY_WAIT):
        for pattern in (SYNC_TENSOR, SYNC_COPY):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"eagleserve/{rel}:{line}: {m.group(0)}")
    assert not offenders, "synchronous copies to the device in serving code:\n" + "\n".join(
        offenders
    )


def test_sync_patterns_catch_a_use() -> None:
    assert SYNC_TENSOR.search("x = torch.tensor([len(o) for o in outs], device=dev)")
    assert SYNC_TENSOR.search("x = torch.tensor(\n    rows,\n    dtype=torch.long,\n    device=d)")
    assert not SYNC_TENSOR.search("x = torch.tensor(rows, dtype=torch.long).to(dev)")
    assert SYNC_COPY.search("dev_idx = idx.to(self.device)")
    assert SYNC_COPY.search("mask.to(device)")
    assert not SYNC_COPY.search("idx.to(dev, non_blocking=True)")
    assert not SYNC_COPY.search("host_to(idx, self.device)")

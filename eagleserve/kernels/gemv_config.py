"""Launch settings of the GEMV kernels (kernels/triton_gemv.py) per weight shape and device.

`bench/tune_gemv.py` measures them on a device and writes configs/gemv_<device>.json, as SGLang
ships its tuned fused-MoE configs; a device with no file runs the defaults below. A setting is
keyed by the kernel, the weight's shape and its dtype, never by the number of rows: a row's bits
then do not depend on the batch (the batch-invariant mode runs these kernels at every size). The
same file says up to how many rows the GEMV kernels beat the per-op fused kernels on that device
for a layer shape (`gemv_max_rows`, models/fused_forward.use_gemv); 0 where it was not measured.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program (norm_qkv_rope: columns of each rotary half)
    block_k: int = 64  # the K step
    split_k: int = 1  # K ranges on programs of their own, summed by a second launch (down proj)
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default for the device

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):  # tl.dot needs both >= 16, tl.arange a power of two
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1 or self.num_warps < 1 or (self.num_stages or 1) < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1: {self}")

    def launch_options(self) -> dict[str, int]:
        """num_warps (and num_stages where set) for a Triton launch."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GemvConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GEMV config fields {sorted(unknown)}")
        return cls(**d)


# The kernels and their defaults (the settings the kernels ran with before any tuning).
DEFAULTS: dict[str, GemvConfig] = {
    "norm_qkv_rope": GemvConfig(block_n=16),
    "norm_gemm": GemvConfig(block_n=32),
    "gemm": GemvConfig(block_n=16),
    "silu_mul_gemm": GemvConfig(block_n=16),
}


@dataclass(frozen=True)
class GemvTable:
    """One device's tuned settings: kernel -> weight shape key -> config, and the layer shapes'
    largest row counts at which the GEMV kernels were faster than the per-op fused ones."""

    configs: dict[str, dict[str, GemvConfig]]
    max_rows: dict[str, int]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_key(n: int, k: int, dtype: torch.dtype) -> str:
    """A weight [N, K] of `dtype` (N: the output columns)."""
    return f"N={n},K={k},{dtype_name(dtype)}"


def layer_key(hidden: int, intermediate: int, dtype: torch.dtype) -> str:
    return f"hidden={hidden},intermediate={intermediate},{dtype_name(dtype)}"


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name ("NVIDIA H200"); "cpu" (the Triton interpreter)."""
    if device.type == "cpu":
        return "cpu"
    return str(torch.get_device_module(device.type).get_device_name(device))


def table_path(name: str, config_dir: Path | None = None) -> Path:
    return (config_dir or CONFIG_DIR) / f"gemv_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json"


def read_table(path: Path) -> GemvTable:
    """The table in `path`; an empty one where there is no file."""
    if not path.is_file():
        return GemvTable({}, {})
    raw = json.loads(path.read_text())
    unknown = set(raw.get("configs", {})) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"{path}: unknown GEMV kernels {sorted(unknown)}")
    configs: dict[str, dict[str, GemvConfig]] = {}
    for kernel, by_shape in raw.get("configs", {}).items():
        for key, entry in by_shape.items():
            try:
                configs.setdefault(kernel, {})[key] = GemvConfig.from_json(entry)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: {kernel} {key}: {e}") from None
    return GemvTable(configs, {k: int(v) for k, v in raw.get("gemv_max_rows", {}).items()})


def write_table(path: Path, table: GemvTable, meta: dict[str, Any]) -> None:
    """`table` with `meta` (the device, versions, the command) as JSON at `path`."""
    payload = {
        **meta,
        "configs": {
            kernel: {key: asdict(c) for key, c in sorted(by_shape.items())}
            for kernel, by_shape in sorted(table.configs.items())
        },
        "gemv_max_rows": dict(sorted(table.max_rows.items())),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    clear_cache()


_override: dict[str, int] = {}


@contextmanager
def overriding(**settings: int) -> Iterator[None]:
    """Every kernel's config with these fields replaced (bench/gpu_kernels.py's fixed modes),
    for launches inside the block; a graph captured inside keeps them."""
    global _override
    saved = _override
    _override = {**saved, **settings}
    _lookup.cache_clear()
    try:
        yield
    finally:
        _override = saved
        _lookup.cache_clear()


@cache
def _table(name: str, config_dir: Path) -> GemvTable:
    return read_table(table_path(name, config_dir))


@lru_cache(maxsize=256)
def _lookup(kernel: str, key: str, device: torch.device, config_dir: Path) -> GemvConfig:
    tuned = _table(device_name(device), config_dir).configs.get(kernel, {})
    config = tuned.get(key, DEFAULTS[kernel])
    return replace(config, **_override) if _override else config


def config_for(kernel: str, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    """The launch settings of `kernel` for a weight [N, K] of `dtype` on `device`."""
    return _lookup(kernel, shape_key(n, k, dtype), device, CONFIG_DIR)


def gemv_max_rows(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> int:
    """Up to how many rows a layer of this shape runs faster on the GEMV kernels on `device`
    (as measured by bench/tune_gemv.py); 0 where it was not measured."""
    table = _table(device_name(device), CONFIG_DIR)
    return table.max_rows.get(layer_key(hidden, intermediate, dtype), 0)


def clear_cache() -> None:
    """Forget the tables read so far (a test or the tuner wrote a new one)."""
    _table.cache_clear()
    _lookup.cache_clear()

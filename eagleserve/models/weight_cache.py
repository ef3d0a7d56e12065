"""A packed CPU target's linears (models/packed_model.py), kept in the cache directory.

Reading a GGUF and packing its blocks for the CPU kernels is most of a packed target's load
on a CPU, and the result depends only on: the GGUF file (its path, size and modification
time: too large to hash at every start), the model's linears (names and shapes) and the
checkpoint folder their biases come from (a fused module carries its members' biases), how
Q8_0 runs and the compute dtype, the tensor-parallel shard, the code that packs (the packing
files, the kernels' layouts, torch's int4pack layout: its version) and whether the CPU kernels
load here. `packed_key` names all of those; a start whose key matches a stored file maps it
(torch.load(mmap=True): the pages are read as the forwards touch them) instead of reading the
GGUF, and does not read the fp weights those modules replace from the checkpoint either; any
other start packs and stores. A file is written whole or not at all (a temporary file renamed
over the old one); one that does not load (truncated, corrupt) or whose key differs (a
collision, a hand edit) is packed over, with a warning.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagleserve.distributed.parallel import get_tp
from eagleserve.kernels import cpu_ext
from eagleserve.models.gguf_weights import QuantTensor
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.models.loader import cache_dir, files_identity, package_version, source_digest
from eagleserve.models.packed_model import FUSED_GROUPS, install_packed, pack_gguf_linears
from eagleserve.models.quant import (
    BF16Linear,
    Int4Linear,
    Int8Linear,
    Q8Int4Linear,
    head_linears,
    set_module,
)

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the stored layout or what a stored module means changes
MAX_FILES = 4  # the least recently used beyond this many are removed when one is stored
# The code whose output is stored: the packing, and the kernels' tile layouts.
_PACKING_CODE = ("models/gguf_weights.py", "models/quant.py", "models/packed_model.py",
                 "models/weight_cache.py", "kernels/cpu_ext.py", "kernels/*.cpp",
                 "kernels/*.h")  # fmt: skip
_CLASSES: dict[str, type[nn.Module]] = {
    c.__name__: c for c in (Int4Linear, Q8Int4Linear, Int8Linear, BF16Linear)
}


def _linears_digest(model: nn.Module) -> str:
    """The names and shapes of the model's linears (what the packing checks the GGUF against)."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            h.update(f"{name}:{tuple(module.weight.shape)};".encode())
    return h.hexdigest()[:16]


def packed_key(
    model: nn.Module, gguf_path: str, checkpoint: str, compute_dtype: torch.dtype, q8_0: str,
    shard_id: tuple[int, int],
) -> dict[str, Any]:  # fmt: skip
    """Everything the packed modules depend on (module docstring), as JSON-able values;
    `checkpoint` is the folder the linears' biases come from."""
    return {
        "format": FORMAT,
        "eagleserve": package_version(),
        "code": source_digest(_PACKING_CODE),
        "torch": str(torch.__version__),
        "kernels": cpu_ext.load(),
        "gguf": files_identity(gguf_path),
        "checkpoint": files_identity(checkpoint),
        "linears": _linears_digest(model),
        "compute_dtype": str(compute_dtype),
        "q8_0": q8_0,
        "shard": list(shard_id),
    }


def packed_path(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    name = os.path.basename(key["gguf"][0]).removesuffix(".gguf")
    return os.path.join(cache_dir(), "packed", f"{name}-{digest}.pt")


def module_state(module: nn.Module) -> dict[str, Any]:
    """A packed module as tensors and plain values (torch.load's weights_only reads it back)."""
    attrs = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    return {
        "class": type(module).__name__,
        "attrs": attrs,  # sizes, compute dtype, the kernels' tiles (`blocked`), a None bias
        "buffers": dict(module._buffers),
        "non_persistent": sorted(module._non_persistent_buffers_set),
        "params": {k: None if p is None else p.data for k, p in module._parameters.items()},
    }


def module_from_state(state: dict[str, Any]) -> nn.Module:
    """The module `module_state` describes, built without packing anything again."""
    cls = _CLASSES[state["class"]]
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in state["attrs"].items():
        setattr(module, name, value)
    for name, tensor in state["buffers"].items():
        module.register_buffer(name, tensor, persistent=name not in state["non_persistent"])
    for name, tensor in state["params"].items():
        param = None if tensor is None else nn.Parameter(tensor, requires_grad=False)
        module.register_parameter(name, param)
    return module.eval()


def load_packed(path: str, key: dict[str, Any]) -> dict[str, nn.Module] | None:
    """The stored modules under `key`, or None (no file; a bad or foreign one is warned of)."""
    if not os.path.exists(path):
        return None
    try:
        stored = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if stored["key"] != key:
            raise ValueError("its key differs")
        modules = {name: module_from_state(s) for name, s in stored["modules"].items()}
    except Exception as exc:  # truncated, corrupt, or not ours: pack again
        logger.warning("ignoring the packed weights in %s (%s: %s); packing them again",
                       path, type(exc).__name__, exc)  # fmt: skip
        return None
    with contextlib.suppress(OSError):  # recently used (store_packed keeps the most recent)
        os.utime(path)
    return modules


def store_packed(path: str, key: dict[str, Any], packed: dict[str, nn.Module]) -> None:
    """Writes the modules whole or not at all (a temporary file renamed into place), then
    removes the least recently used files beyond MAX_FILES."""
    folder = os.path.dirname(path)
    payload = {"key": key, "modules": {n: module_state(m) for n, m in packed.items()}}
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # a full or read-only cache (torch's writer raises
        # RuntimeError): this start runs on what it packed, the next packs again
        logger.warning("could not store the packed weights in %s: %s", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        return
    stored = sorted(glob.glob(os.path.join(folder, "*.pt")), key=_mtime, reverse=True)
    for old in stored[MAX_FILES:]:
        with contextlib.suppress(OSError):  # another process removed it first
            os.remove(old)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # removed meanwhile
        return 0.0


@dataclass
class PackedLookup:
    """What the cache holds for one packed load: `modules` when a stored file fits, else None
    (`install` packs and stores them)."""

    key: dict[str, Any]
    path: str
    modules: dict[str, nn.Module] | None
    compute_dtype: torch.dtype
    q8_0: str

    def replaced_weights(self) -> set[str]:
        """The checkpoint weights the stored modules replace (a loader need not read them);
        none on a miss, where the packing checks the GGUF against the loaded model."""
        out: set[str] = set()
        for name in self.modules or ():
            parent, _, attr = name.rpartition(".")
            prefix = f"{parent}." if parent else ""
            out.update(f"{prefix}{m}.weight" for m in FUSED_GROUPS.get(attr, (attr,)))
        return out

    def install(
        self,
        model: LlamaForCausalLM,
        gguf_path: str,
        shard: Callable[[str, QuantTensor], QuantTensor] | None = None,
    ) -> None:
        """Puts the packed modules in `model`: the stored ones, else packed from the GGUF (the
        model's biases loaded) and stored for the next start."""
        packed = self.modules
        if packed is None:
            t0 = time.perf_counter()
            packed = pack_gguf_linears(model, gguf_path, self.compute_dtype, self.q8_0, shard)
            t1 = time.perf_counter()
            store_packed(self.path, self.key, packed)
            logger.info("start-up: GGUF linears packed in %.2f s, stored in %s (%.2f s)",
                        t1 - t0, self.path, time.perf_counter() - t1)  # fmt: skip
        install_packed(model, packed)


def find_packed(
    model: nn.Module,
    gguf_path: str,
    checkpoint: str,
    compute_dtype: torch.dtype = torch.bfloat16,
    q8_0: str = "int4x2",
    shard_id: tuple[int, int] = (0, 1),
) -> PackedLookup:
    """The stored packed modules for this load (packed_model.pack_gguf_linears' arguments;
    `model` may still be unloaded: only its linears' names and shapes are read). shard_id:
    (rank, size) of the tensor-parallel slice the packing cuts."""
    t0 = time.perf_counter()
    key = packed_key(model, gguf_path, checkpoint, compute_dtype, q8_0, shard_id)
    path = packed_path(key)
    modules = load_packed(path, key)
    if modules is not None:
        logger.info("start-up: packed weights reused from %s (%.2f s)", path,
                    time.perf_counter() - t0)  # fmt: skip
    return PackedLookup(key, path, modules, compute_dtype, q8_0)


def pack_head_linears_cached(module: nn.Module, sources: tuple[str, ...]) -> None:
    """quant.pack_head_linears through the cache: the draft head's 4-bit linears, keyed like the
    target's packed ones by the files their weights come from (`sources`: the head's folder
    and the target's GGUF, which a head may take rows from), the linears' names and shapes,
    the code and torch."""
    t0 = time.perf_counter()
    tp = get_tp()
    key = {
        "format": FORMAT,
        "kind": "head linears",
        "eagleserve": package_version(),
        "code": source_digest(_PACKING_CODE),
        "torch": str(torch.__version__),
        "kernels": cpu_ext.load(),
        "sources": [files_identity(s) for s in sources],
        "linears": _linears_digest(module),
        "tp": [tp.rank, tp.size],  # a head is whole on every rank; its sources may not be
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    name = os.path.basename(os.path.normpath(sources[0]))
    path = os.path.join(cache_dir(), "packed", f"{name}-head-{digest}.pt")
    modules = load_packed(path, key)
    if modules is None:
        modules = head_linears(module)
        store_packed(path, key, modules)
        logger.info("start-up: %s linears packed and stored in %.2f s", name,
                    time.perf_counter() - t0)  # fmt: skip
    else:
        logger.info("start-up: %s linears reused from %s (%.2f s)", name, path,
                    time.perf_counter() - t0)  # fmt: skip
    for mod_name, new in modules.items():
        set_module(module, mod_name, new)

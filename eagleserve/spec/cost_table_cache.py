"""The adaptive controller's cost table (spec/cost_model.py), kept in the cache directory.

Timing the table is most of a speculative engine's start-up on a CPU, and what it measures
depends only on what the forwards run on and how: the device, the target's and the head's
weights, the dtype, the thread count (and libgomp's spin settings), the code that runs, and the
shapes timed. `table_key` names all of those; a start whose key matches a stored table takes it
instead of timing (the controller's online EMA refines it from there, as it refines a fresh
one), and a start whose key matches none, or that asks for it (--speculative-adaptive-retime),
times a table and stores it. A table is written whole or not at all (a temporary file renamed
over the old one), so a reader never sees part of one; a file that does not parse, or whose key
differs (a hash collision, a hand edit), is timed over.

Under tensor parallelism each rank times and keeps its own table (its rank is in the key), and
the ranks decide together: timing runs forwards whose collectives must meet, so one rank
without a table makes every rank time its own.
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
from typing import Any

import torch

from eagleserve.config import ServerArgs
from eagleserve.device import device_name
from eagleserve.distributed.parallel import all_gather_object, get_tp
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.loader import (
    PACKAGE_ROOT,
    cache_dir,
    files_identity,
    package_version,
    resolve_draft_path,
    resolve_model_path,
    source_digest,
)
from eagleserve.spec import cost_model
from eagleserve.spec.cost_table import CostTable
from eagleserve.spec.draft_worker import EagleDraftWorker

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the stored layout or what a table means changes
# The least recently used beyond this many are removed when one is stored (a test suite makes
# a table per temporary model: they must not push out the served model's).
MAX_TABLES = 256
PACKAGE = PACKAGE_ROOT
# The code a forward runs (the server's and training's do not move the timings).
TIMED_CODE = ("kernels", "models", "layers", "model_executor", "mem_cache", "sampling", "spec",
              "core.py", "device.py", "config.py")  # fmt: skip
SPIN_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def code_digest(root: str = PACKAGE) -> str:
    """A hash of the source a forward runs (TIMED_CODE), so an edited kernel is timed anew."""
    return source_digest(TIMED_CODE, root)


def table_key(
    runner: ModelRunner,
    drafter: EagleDraftWorker,
    args: ServerArgs,
    buckets: tuple[int, ...],
    choices: tuple[int, ...],
) -> dict[str, Any]:
    """Everything the timings depend on (module docstring), as JSON-able values."""
    spec, tp = drafter.spec, get_tp()
    return {
        "format": FORMAT,
        "eagleserve": package_version(),
        "code": code_digest(),
        "torch": torch.__version__,
        "device": device_name(runner.device),
        "threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in SPIN_ENV},
        "tp": [tp.rank, tp.size],
        "model": files_identity(resolve_model_path(args.model)),
        "load_format": args.load_format,
        "packed_gguf": files_identity(runner.gguf_path) if runner.gguf_path else None,
        "head": files_identity(resolve_draft_path(spec.draft_model_path)),
        "dtype": str(runner.dtype),
        "spec": [spec.algorithm, spec.num_steps, spec.eagle_topk, spec.num_draft_tokens],
        "buckets": list(buckets),
        "choices": list(choices),
        "max_total_tokens": runner.token_to_kv_pool.size,
        "attention": [type(runner.attn_backend).__name__, type(drafter.attn_backend).__name__],
        "graphs": [len(runner.graphs), drafter.graph is not None],
        "timing": [cost_model.CONTEXT, cost_model.REPEATS],
    }


def table_path(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "cost_tables", f"{digest}.json")


def table_to_json(table: CostTable) -> dict[str, Any]:
    """The start-up measurement (the online scales are this run's own)."""
    return {
        "buckets": list(table.buckets),
        "seconds": [[b, k, s] for (b, k), s in sorted(table.seconds.items())],
        "catch_up": [[b, s] for b, s in sorted(table.catch_up.items())],
    }


def table_from_json(data: dict[str, Any]) -> CostTable:
    return CostTable(
        tuple(int(b) for b in data["buckets"]),
        {(int(b), int(k)): float(s) for b, k, s in data["seconds"]},
        catch_up={int(b): float(s) for b, s in data["catch_up"]},
    )


def load_table(path: str, key: dict[str, Any]) -> CostTable | None:
    """The table stored at `path` under exactly `key`; None when there is none that fits."""
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") != key:
            return None
        table = table_from_json(data["table"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    wanted = {(b, k) for b in key["buckets"] for k in key["choices"]}
    return table if set(table.seconds) == wanted else None


def save_table(path: str, key: dict[str, Any], table: CostTable) -> None:
    """Writes the table whole (a temporary file renamed over `path`), then keeps the
    MAX_TABLES most recently used tables of the folder (a reuse touches its file)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "table": table_to_json(table)}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    tables = sorted(glob.glob(os.path.join(folder, "*.json")), key=os.path.getmtime)
    for old in tables[:-MAX_TABLES]:
        with contextlib.suppress(OSError):
            os.unlink(old)


def cost_table(
    runner: ModelRunner,
    drafter: EagleDraftWorker,
    args: ServerArgs,
    buckets: tuple[int, ...],
    choices: tuple[int, ...],
) -> CostTable:
    """The stored table that fits this engine, else (or with --speculative-adaptive-retime) a
    freshly timed one, then stored. Every tensor-parallel rank takes the same branch."""
    t0 = time.perf_counter()
    key = table_key(runner, drafter, args, buckets, choices)
    path = table_path(key)
    stored = None if args.speculative_adaptive_retime else load_table(path, key)
    if all(all_gather_object(stored is not None)):
        assert stored is not None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept by save_table's pruning
        if runner.device.type != "cpu":  # kernels compile on first use (Triton, a CPU none)
            cost_model.warm_up(runner, drafter, choices)
        logger.info("start-up: cost table reused from %s (%.2f s)", path,
                    time.perf_counter() - t0)  # fmt: skip
        return stored
    why = (
        "--speculative-adaptive-retime" if args.speculative_adaptive_retime
        else "no stored table fits" if stored is None
        else "another rank has none"
    )  # fmt: skip
    table = cost_model.measure_costs(runner, drafter, buckets, choices)
    try:
        save_table(path, key, table)
    except OSError as exc:  # a read-only cache costs the next start a timing run, no more
        logger.warning("cost table not stored (%s): %s", path, exc)
    logger.info("start-up: cost table timed (%s) in %.2f s, stored in %s", why,
                time.perf_counter() - t0, path)  # fmt: skip
    return table

"""The torch profiler around the engine's steps (SGLang's and vLLM's /start_profile and
/stop_profile, and the offline Engine's start_profile / stop_profile).

A trace covers the steps between start and stop (or the `num_steps` after start), each step a
`eagleserve.step` span, so the device's idle time per iteration reads off the trace. It is
written as a gzipped Chrome trace (chrome://tracing, Perfetto) into the request's `output_dir`,
else $EAGLESERVE_TORCH_PROFILER_DIR (SGLang's SGLANG_TORCH_PROFILER_DIR, vLLM's
VLLM_TORCH_PROFILER_DIR where ours is unset), else /tmp as SGLang's default. Under tensor
parallelism it profiles rank 0.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile, record_function

from eagleserve.device import pick_device
from eagleserve.messages import ProfileReq, ProfileResult

logger = logging.getLogger(__name__)
R = TypeVar("R")

DIR_ENVS = ("EAGLESERVE_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")
ACTIVITIES = ("CPU", "GPU")


def trace_dir(asked: str | None) -> str:
    if asked:
        return asked
    return next((os.environ[e] for e in DIR_ENVS if os.environ.get(e)), "/tmp")


def profiler_activities(names: tuple[str, ...]) -> list[ProfilerActivity] | str:
    """torch's activities for SGLang's names (GPU: the accelerator's, where there is one), or
    what is wrong with them."""
    bad = [n for n in names if n not in ACTIVITIES]
    if bad or not names:
        return f"activities must be some of {', '.join(ACTIVITIES)} (got {list(names)})"
    out = [ProfilerActivity.CPU] if "CPU" in names else []
    if "GPU" in names and pick_device("auto").type != "cpu":  # CUDA's activity is HIP's too
        out.append(ProfilerActivity.CUDA)
    return out or "activities: GPU only, and this engine runs on no GPU"


class EngineProfiler:
    def __init__(self) -> None:
        self._prof: profile | None = None
        self._path: str | None = None
        self._steps_left: int | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, req: ProfileReq) -> ProfileResult:
        if self._prof is not None:
            return ProfileResult(False, "the profiler is already running", self._path)
        if req.num_steps is not None and req.num_steps < 1:
            return ProfileResult(False, "num_steps must be at least 1")
        activities = profiler_activities(tuple(req.activities))
        if isinstance(activities, str):
            return ProfileResult(False, activities)
        folder = trace_dir(req.output_dir)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            return ProfileResult(False, f"output_dir {folder!r}: {exc.strerror or exc}")
        if not os.access(folder, os.W_OK):
            return ProfileResult(False, f"output_dir {folder!r} is not writable")
        name = f"eagleserve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.trace.json.gz"
        self._path = os.path.join(folder, name)
        self._prof = profile(activities=activities, record_shapes=req.record_shapes,
                             with_stack=req.with_stack)  # fmt: skip
        self._prof.start()
        self._steps_left = req.num_steps
        logger.info("torch profiler started; the trace goes to %s", self._path)
        return ProfileResult(True, "profiling", self._path)

    def stop(self) -> ProfileResult:
        prof, path = self._prof, self._path
        if prof is None or path is None:
            return ProfileResult(False, "the profiler is not running")
        self._prof = self._path = self._steps_left = None
        prof.stop()
        t0 = time.perf_counter()
        # Written beside it, then renamed: a trace file that exists is whole.
        partial = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
        prof.export_chrome_trace(partial)
        os.replace(partial, path)
        logger.info("torch profiler trace written to %s in %.1f s", path, time.perf_counter() - t0)
        return ProfileResult(True, "trace written", path)

    def step(self, run: Callable[[], R]) -> R:
        """`run()`, one scheduler step: while profiling, a span in the trace (the profiler
        stops after its last one); else just the call (the engine loop's hot path)."""
        if self._prof is None:
            return run()
        with record_function("eagleserve.step"):
            result = run()
        if self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left == 0:
                self.stop()
        return result

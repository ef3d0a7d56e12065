"""SGLang's and vLLM's /start_profile and /stop_profile: the engine's torch profiler around its
steps (scheduler/profiler.py), for finding where an iteration's time goes on a deployment."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from eagleserve.messages import ProfileReq, ProfileResult
from eagleserve.server.serving import ApiError


class StartProfileRequest(BaseModel):
    """SGLang's /start_profile body (all optional; vLLM sends none). The trace goes to
    `output_dir`, else $EAGLESERVE_TORCH_PROFILER_DIR (or SGLang's or vLLM's variable), else
    /tmp; `num_steps`: stop by itself after that many engine steps."""

    model_config = ConfigDict(extra="ignore")

    output_dir: str | None = None
    num_steps: int | None = Field(None, ge=1)
    activities: list[Literal["CPU", "GPU"]] = Field(default_factory=lambda: ["CPU", "GPU"])
    record_shapes: bool = False
    with_stack: bool = False
    # SGLang's, refused unless unset (REFUSED_PROFILE).
    start_step: int | None = None
    profile_by_stage: bool = False


REFUSED_PROFILE = ("start_step", "profile_by_stage")


class ProfileAnswer(BaseModel):
    message: str
    trace_path: str | None = None  # the trace file being written (start) or written (stop)


def profile_request(body: StartProfileRequest) -> ProfileReq | ApiError:
    for name in REFUSED_PROFILE:
        if getattr(body, name):
            msg = f"{name} is not supported by this server; leave it unset"
            return ApiError(400, msg, name, "unsupported_parameter")
    return ProfileReq(True, body.output_dir, body.num_steps, tuple(body.activities),
                      body.record_shapes, body.with_stack)  # fmt: skip


def profile_answer(result: ProfileResult) -> ProfileAnswer | ApiError:
    """The engine's answer: 200, or 400 with its reason (already running, not running, an
    output folder it cannot write, no GPU for GPU-only activities)."""
    if not result.ok:
        return ApiError(400, result.message)
    return ProfileAnswer(message=result.message, trace_path=result.trace_path)

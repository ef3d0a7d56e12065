"""eagleserve: a minimal EAGLE speculative-decoding inference server."""

from __future__ import annotations

from typing import Any

from eagleserve.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Imported lazily so `import eagleserve` stays cheap for the HTTP process.
    if name == "Engine":
        from eagleserve.engine import Engine

        return Engine
    raise AttributeError(name)

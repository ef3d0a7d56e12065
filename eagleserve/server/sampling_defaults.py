"""`--sampling-defaults` (SGLang's flag): what an OpenAI request's unset sampling fields mean.
`model` (the default, as SGLang's and vLLM's): the model's generation_config.json, where it
sets `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` or `max_new_tokens` (a
chat's or a response's default length; vLLM reads the same keys); `openai`: OpenAI's
(temperature 1, top_p 1, no top-k or min-p, no repetition penalty, the rest of the context).
SGLang's native /generate keeps its own defaults (server/generate.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

MODES = ("model", "openai")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None  # None: the rest of the context

    def changed(self) -> dict[str, Any]:
        """The settings that differ from OpenAI's (for the start-up log)."""
        base = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}  # fmt: skip


def _checked(key: str, value: Any) -> float | int:
    """A generation_config value in range, as a request's would have to be (ValueError)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    whole = key in ("top_k", "max_new_tokens")
    if not is_number or (whole and not isinstance(value, int)):
        raise ValueError(f"{key} must be {'an integer' if whole else 'a number'}, not {value!r}")
    ok = {
        "temperature": value >= 0, "top_p": 0 < value <= 1, "top_k": value >= -1,
        "min_p": 0 <= value <= 1, "repetition_penalty": value > 0, "max_new_tokens": value >= 1,
    }[key]  # fmt: skip
    if not ok:
        raise ValueError(f"{key} {value!r} is out of range")
    return -1 if key == "top_k" and value == 0 else value  # HF's top_k 0: off


def read_sampling_defaults(model_path: str, mode: str) -> SamplingDefaults:
    """The defaults `mode` gives for the model in `model_path` (ValueError naming the file and
    key if its generation_config.json is not JSON or holds a value out of range)."""
    mode = mode.lower()
    if mode not in MODES:
        raise ValueError(f"--sampling-defaults {mode!r}: one of {', '.join(MODES)}")
    path = os.path.join(model_path, "generation_config.json")
    if mode == "openai" or not os.path.isfile(path):
        return SamplingDefaults()
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        values = {f.name: _checked(f.name, raw[f.name]) for f in fields(SamplingDefaults)
                  if raw.get(f.name) is not None}  # fmt: skip
    except ValueError as exc:  # json's decode error is one too
        raise ValueError(f"{path}: {exc} (--sampling-defaults openai ignores the file)") from None
    return SamplingDefaults(**values)

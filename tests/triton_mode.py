"""Imported first by tests/conftest.py (and by the Triton kernel tests, for their DEVICE): where a
GPU is present the kernels run on it for real; elsewhere under Triton's CPU interpreter, which must
be chosen before triton is imported (`triton.language`'s own jit functions, `tl.zeros` among them,
are defined for the interpreter only then)."""

from __future__ import annotations

import os

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

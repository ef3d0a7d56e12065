"""kernels/triton_interpreter.py: what the CPU interpreter gives a kernel is what a GPU gives it
(a device function called inside a launch, a launch's patch undone after it, a bf16 cast that
rounds to nearest even). On a GPU these kernels are compiled and the checks hold there too."""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from eagleserve.kernels import triton_interpreter  # noqa: E402, F401 (applies the fixes)


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _twice_scaled_kernel(X, Out, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Out + offs, _scaled(_scaled(x, scale), scale).to(Out.dtype.element_ty), mask=mask)


def _language_members() -> dict[str, object]:
    return {name: getattr(tl, name) for name in ("load", "store", "arange", "program_id")}


def test_nested_device_functions_compute_and_the_language_is_restored_after() -> None:
    """Device functions called inside a launch (twice, nested in one expression, over several
    programs) give torch's values, and after the launch triton.language is as before it: the
    launch's patch, which nested calls do not redo, is undone."""
    before = _language_members()
    n = int(torch.randint(200, 600, ()))
    x = torch.randn(n, device=DEVICE)
    scale = float(torch.rand(()) + 0.5)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(n, dtype=dtype, device=DEVICE)
        _twice_scaled_kernel[(triton.cdiv(n, 128),)](x, out, n, scale, BLOCK=128)
        assert torch.equal(out, (x * scale * scale).to(dtype))
    assert _language_members() == before


@triton.jit
def _accumulated_kernel(X, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)  # triton.language's own jit function
    acc += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Out + offs, acc, mask=offs < n)


def test_the_languages_own_jit_functions_run_in_a_kernel() -> None:
    """`tl.zeros` (a jit function of triton.language, not a builtin) runs inside a launch. Under
    the interpreter it does only if TRITON_INTERPRET was set before triton was first imported
    (tests/conftest.py sees to it, whichever test module is collected first); imported earlier,
    every attention kernel failed with "Cannot call @triton.jit'd outside of the scope of a
    kernel"."""
    n = int(torch.randint(100, 400, ()))
    x = torch.randn(n, device=DEVICE)
    out = torch.empty_like(x)
    _accumulated_kernel[(triton.cdiv(n, 64),)](x, out, n, BLOCK=64)
    assert torch.equal(out, x)

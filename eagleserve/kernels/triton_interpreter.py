"""Fixes for Triton's CPU interpreter (TRITON_INTERPRET=1), applied on import; a no-op otherwise.

Imported by every module that defines Triton kernels, so tests on a host without a GPU run them
as a GPU would.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import triton.language as tl


def _fix_interpreter() -> None:
    """Three defects of Triton's CPU interpreter (3.6) that compiled kernels (a GPU) do not have,
    and one cost (`_patched_once_per_launch`):
    - it holds a kernel scalar as a 1-element array and gives it `__index__ = int(array)`, which
      numpy >= 2.4 refuses for ndim > 0: every `range(a, b)` with a loaded bound (all attention
      loops) fails with "only 0-dimensional arrays can be converted to Python scalars". Its
      per-launch patch is wrapped so `__index__` reads the one element.
    - its fp32 -> bf16 cast truncates, where a GPU (and torch) rounds to nearest even: the
      cast is given the rounding mode the compiled kernel uses.
    - its `tl.dot` is numpy's matmul in fp32, whose BLAS may reduce some rows of a tile in
      another order than others (seen on a 2-core AMD EPYC), so a row's result depends on its
      place in the tile; a GPU's MMA reduces every output the same way. Floating dots multiply
      in fp64 (each fp32 product exact) and round once to fp32: sums in different orders then
      round apart only within about 1e-16 of an fp32 rounding boundary."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "scalar_index_fixed", False):
        return

    def patch_lang(fn):  # noqa: ANN001, ANN202 (triton's signature)
        scope = patch(fn)
        scope.set_attr(tl.core.tensor, "__index__", lambda t: int(t.handle.data.reshape(-1)[0]))
        return scope

    patch_lang.scalar_index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang = _patched_once_per_launch(patch_lang, interpreter)

    builder = interpreter.InterpreterBuilder
    trunc = builder.create_fp_trunc

    def fp_trunc(self, src, dst_type):  # noqa: ANN001, ANN202
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return trunc(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        # Round to nearest even on the upper 16 bits; NaN stays a (quiet) NaN.
        out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out = np.where(np.isnan(src.data), np.uint16(0x7FC0), out)
        return interpreter.TensorHandle(out, dst_type.scalar)

    builder.create_fp_trunc = fp_trunc
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        kinds = (a.data.dtype.kind, b.data.dtype.kind, d.data.dtype)
        if kinds != ("f", "f", np.float32):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle((exact + d.data).astype(np.float32), d.dtype.scalar)

    builder.create_dot = create_dot
    _lighten_type_bookkeeping(interpreter)


def _lighten_type_bookkeeping(interpreter) -> None:  # noqa: ANN001
    """Two costs of every interpreted op that change nothing it computes (the language's
    Python runs once per op and program): `tl.tuple_type` formats its name at construction,
    for each of the tuples a block's shape makes, where the name is read only when printed; and
    `_get_np_dtype` builds its table of numpy types at every call. The name is formatted on
    first use instead, and each scalar type's numpy type is kept. Triton 3.6's definitions
    (the version the CPU set-up installs); another version keeps its own."""
    import triton

    if not triton.__version__.startswith("3.6."):
        return
    tuple_type = tl.core.tuple_type

    def tuple_init(self, types, fields=None):  # noqa: ANN001, ANN202 (triton's signature)
        self.types = types
        self.fields = fields or [""] * len(types)

    def tuple_name(self, attr: str) -> str:  # only for attributes the instance lacks
        if attr != "name":
            raise AttributeError(attr)
        fields, types = self.__dict__.get("fields", ()), self.__dict__.get("types", ())
        self.name = "[" + ",".join(f"{k}:{v}" for k, v in zip(fields, types)) + "]"
        return self.name

    tuple_type.__init__ = tuple_init
    tuple_type.__getattr__ = tuple_name
    np_dtype = interpreter._get_np_dtype
    by_scalar: dict[str, np.dtype] = {}

    def get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202
        # The numpy type depends on the scalar (element) type alone.
        key = str(tt_dtype.scalar)
        found = by_scalar.get(key)
        if found is None:
            found = by_scalar[key] = np_dtype(tt_dtype)
        return found

    interpreter._get_np_dtype = get_np_dtype


def _patched_once_per_launch(patch_lang, interpreter):  # noqa: ANN001, ANN202
    """`patch_lang` that a device function called inside a launch skips when its language
    modules (`tl`, `tl.core`: a reduction's combine function sees only the latter) were
    patched earlier in the launch. The interpreter re-patches them at every such call (most of
    a small kernel's time: each patch walks the modules' members) with equivalent wrappers
    that nothing restores, so the first patch of each module stays in force either way."""
    state = threading.local()  # the language modules the running launch patched, per thread
    grid_call = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN202
        state.patched = frozenset()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.patched = None

    def patch_once(fn):  # noqa: ANN001, ANN202
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        patched = getattr(state, "patched", None)
        if patched and langs <= patched:
            return interpreter._LangPatchScope()  # discarded by the caller, as its patch was
        scope = patch_lang(fn)
        if patched is not None:  # in force until the launch ends (a nested patch is never undone)
            state.patched = patched | langs
        return scope

    interpreter.GridExecutor.__call__ = launch
    return patch_once


_fix_interpreter()

"""kernels/cpu_ext.py's build: where the compiler fails, the engine keeps torch's kernels and
the cache holds nothing half-built for the next start to load."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

from eagleserve.kernels import cpu_ext


def test_a_failing_compiler_falls_back_and_leaves_no_library(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not cpu_ext.cpu_supported():
        pytest.skip("no AVX2/FMA/F16C: load() never builds here")
    compiler = tmp_path / "broken-c++"
    compiler.write_text('#!/bin/sh\necho "broken-c++: internal error" >&2\nexit 1\n')
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("EAGLESERVE_CACHE", str(cache))
    monkeypatch.setattr(cpu_ext, "_loaded", None)
    with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
        assert cpu_ext.load() is False
        assert cpu_ext.load() is False  # decided once: no second build attempt
    assert "broken-c++: internal error" in caplog.text
    assert caplog.text.count("AVX2 CPU kernels unavailable") == 1
    assert os.listdir(cache / "kernels") == []  # neither a library nor a build folder left

"""`eagleserve serve` flags: one per ServerArgs field, config file, precedence, help."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from eagleserve.cli import FIELD_HELP, build_parser, build_server_args, serve_fields
from eagleserve.config import ServerArgs


def parse(argv: list[str]) -> ServerArgs | str:
    return build_server_args(build_parser().parse_args(["serve", *argv]))


def test_every_field_has_a_flag_and_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eagleserve", "serve", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    for f in serve_fields():
        assert "--" + f.name.replace("_", "-") in proc.stdout, f.name
    assert "--config" in proc.stdout
    assert set(FIELD_HELP) == {f.name for f in serve_fields()}, "FIELD_HELP out of date"


def test_defaults_are_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLESERVE_API_KEY", raising=False)
    assert parse([]) == ServerArgs()


def test_flags_map_one_to_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLESERVE_API_KEY", raising=False)
    args = parse(
        ["--model", "/m", "--host", "0.0.0.0", "--port", "9000", "--device", "cpu",
         "--dtype", "float32", "--max-running-requests", "8", "--kv-cache-tokens", "1024",
         "--max-context-len", "512", "--served-model-name", "x", "--api-key", "k",
         "--seed", "7", "--speculative-algorithm", "EAGLE",
         "--speculative-draft-model-path", "/d", "--speculative-num-steps", "4",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
         "--disable-overlap-schedule", "--attention-backend", "torch", "--disable-cuda-graph",
         "--cuda-graph-max-bs", "16", "--log-level", "debug"]
    )  # fmt: skip
    assert isinstance(args, ServerArgs)
    assert args == ServerArgs(
        model="/m", host="0.0.0.0", port=9000, device="cpu", dtype="float32",
        max_running_requests=8, kv_cache_tokens=1024, max_context_len=512,
        served_model_name="x", api_key="k", seed=7, speculative_algorithm="EAGLE",
        speculative_draft_model_path="/d", speculative_num_steps=4, speculative_eagle_topk=1,
        speculative_num_draft_tokens=5, disable_overlap_schedule=True, attention_backend="torch",
        disable_cuda_graph=True, cuda_graph_max_bs=16, log_level="debug",
    )  # fmt: skip
    tested = {f.name for f in dataclasses.fields(ServerArgs)} - {"extra"}
    assert all(getattr(args, n) != getattr(ServerArgs(), n) for n in tested)


def test_config_file_and_flag_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLESERVE_API_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: default\nport: 1234\ndisable_cuda_graph: true\nkv_cache_tokens: 99\n")
    args = parse(["--config", str(cfg), "--port", "4321", "--no-disable-cuda-graph"])
    assert isinstance(args, ServerArgs)
    assert (args.port, args.kv_cache_tokens, args.disable_cuda_graph) == (4321, 99, False)


def test_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("no_such_field: 1\n")
    assert "unknown fields" in str(parse(["--config", str(cfg)]))
    assert "not found" in str(parse(["--config", str(tmp_path / "missing.yaml")]))


def test_bad_speculative_flags_are_reported() -> None:
    err = parse(["--speculative-algorithm", "EAGLE"])
    assert isinstance(err, str) and "draft-model-path" in err


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLESERVE_API_KEY", "from-env")
    assert parse([]).api_key == "from-env"
    assert parse(["--api-key", "flag"]).api_key == "flag"


def test_bad_flag_value_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eagleserve", "serve", "--port", "abc"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--port" in proc.stderr


def test_startup_failure_exits_nonzero(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eagleserve", "serve", "--model", str(tmp_path / "nope"),
         "--device", "cpu", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "engine failed to start" in proc.stderr

"""`eagleserve serve` flags: one per ServerArgs field, config file, precedence, help."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagleserve import Engine
from eagleserve.cli import build_parser, build_server_args, serve_fields
from eagleserve.config import RENAMED_FIELDS, ServerArgs
from eagleserve.flag_help import FIELD_HELP, VLLM_FLAGS


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


BRIEF_FLAGS = ["--model", "--host", "--port", "--device", "--dtype", "--max-running-requests",
               "--max-total-tokens", "--served-model-name", "--api-key",
               "--speculative-algorithm", "--speculative-draft-model-path",
               "--speculative-num-steps", "--speculative-eagle-topk",
               "--speculative-num-draft-tokens", "--disable-overlap-schedule",
               "--attention-backend", "--disable-cuda-graph", "--cuda-graph-max-bs"]  # fmt: skip


def test_flags_map_one_to_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLESERVE_API_KEY", raising=False)
    defaults = ServerArgs()
    argv: list[str] = []
    expected: dict[str, object] = {}
    for f in serve_fields():
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        kind = str(f.type)
        if kind.startswith("bool"):
            argv.append(flag if not value else "--no-" + flag[2:])
            expected[f.name] = not value
        elif kind.startswith("int"):
            argv += [flag, str((value or 0) + 3)]
            expected[f.name] = (value or 0) + 3
        elif kind.startswith("float"):
            argv += [flag, str(value / 2 + 0.25)]
            expected[f.name] = value / 2 + 0.25
        else:
            text = "EAGLE3" if f.name == "speculative_algorithm" else f"v-{f.name}"
            argv += [flag, text]
            expected[f.name] = text
    args = parse(argv)
    assert isinstance(args, ServerArgs)
    assert args == dataclasses.replace(defaults, **expected)
    assert set(BRIEF_FLAGS) <= set(argv)


def test_speculative_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(
        ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d",
         "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5"]
    )  # fmt: skip
    assert isinstance(args, ServerArgs) and args.spec_config is not None
    assert (args.spec_config.num_steps, args.spec_config.num_draft_tokens) == (4, 5)
    assert not args.spec_config.adaptive
    adaptive = parse(
        ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d",
         "--speculative-adaptive", "--speculative-adaptive-probe-interval", "9"]
    )  # fmt: skip
    assert isinstance(adaptive, ServerArgs) and adaptive.spec_config is not None
    assert (adaptive.spec_config.adaptive, adaptive.spec_config.adaptive_probe_interval) == (
        True,
        9,
    )
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d"]
    bad = parse([*spec, "--speculative-adaptive", "--speculative-adaptive-probe-interval", "0"])
    assert "probe-interval must be at least 1" in str(bad)
    cut = parse([*spec, "--speculative-min-path-prob", "0.3"])
    assert isinstance(cut, ServerArgs) and cut.spec_config is not None
    assert cut.spec_config.min_path_prob == 0.3
    for value in ("1.5", "-0.1"):
        bad = parse([*spec, "--speculative-min-path-prob", value])
        assert "--speculative-min-path-prob must be in [0, 1]" in str(bad)


def test_config_file_and_flag_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLESERVE_API_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: default\nport: 1234\ndisable_cuda_graph: true\nmax_total_tokens: 99\n")
    args = parse(["--config", str(cfg), "--port", "4321", "--no-disable-cuda-graph"])
    assert isinstance(args, ServerArgs)
    assert (args.port, args.max_total_tokens, args.disable_cuda_graph) == (4321, 99, False)


def test_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("no_such_field: 1\n")
    assert "unknown fields" in str(parse(["--config", str(cfg)]))
    assert "not found" in str(parse(["--config", str(tmp_path / "missing.yaml")]))


def test_renamed_fields_name_their_new_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag, YAML field or Engine argument renamed to SGLang's name is an error naming it."""
    for old, new in RENAMED_FIELDS.items():
        with pytest.raises(SystemExit) as exit_info:
            parse(["--" + old.replace("_", "-"), "7"])
        assert exit_info.value.code == 2
        assert "--" + new.replace("_", "-") in capsys.readouterr().err
        cfg = tmp_path / f"{old}.yaml"
        cfg.write_text(f"{old}: 7\n")
        assert f"{old} -> {new}" in str(parse(["--config", str(cfg)]))
        with pytest.raises(TypeError, match=f"{old} -> {new}"):
            Engine(**{old: 7})
        assert getattr(parse(["--" + new.replace("_", "-"), "7"]), new) == 7


@pytest.mark.parametrize("flag", sorted(VLLM_FLAGS))
def test_a_vllm_flag_names_what_eagleserve_takes(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's flags (with a value or without) stop `serve` in one line that says what to use,
    and every flag that line names is one of eagleserve's."""
    ours = {"--" + f.name.replace("_", "-") for f in serve_fields()}
    for argv in ([flag], [flag, "2"]):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{flag} is vLLM's flag: {VLLM_FLAGS[flag]}" in err
    named = re.findall(r"--[a-z-]+[a-z]", VLLM_FLAGS[flag])
    assert all(n in ours for n in named), (named, flag)


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


def test_startup_failure_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eagleserve", "serve", "--model", str(tmp_path / "nope"),
         "--device", "cpu", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2  # a configuration error (tests/server/test_startup.py)
    assert "is not a model folder" in proc.stderr


def test_overlap_schedule_defaults_to_off_on_cpu_only() -> None:
    # Unset: off on a CPU (measured slower on 2 cores), on for an accelerator; a flag decides.
    assert ServerArgs().overlap_schedule("cpu") is False
    assert ServerArgs().overlap_schedule("cuda") is True
    assert ServerArgs(disable_overlap_schedule=False).overlap_schedule("cpu") is True
    assert ServerArgs(disable_overlap_schedule=True).overlap_schedule("cuda") is False
    assert parse(["--no-disable-overlap-schedule"]).disable_overlap_schedule is False


def test_help_is_grouped_with_each_default_once() -> None:
    from eagleserve.flag_help import FIELD_GROUPS

    grouped = [name for names in FIELD_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in serve_fields()), "a field has no group"
    out = subprocess.run(
        [sys.executable, "-m", "eagleserve", "serve", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    titles = [f"\n{title}:\n" for title in FIELD_GROUPS]
    positions = [out.find(t) for t in titles]
    assert -1 not in positions and positions == sorted(positions), positions
    entries = re.split(r"\n  (?=--)", out)  # one per flag, wrapped lines joined
    for entry in entries:
        assert entry.count("(default") <= 1, entry
    assert "(default: 16777216)" in out and "(default: None)" not in out

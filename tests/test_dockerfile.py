"""The Dockerfile lints clean and starts the same CLI the README documents."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import tomllib

from eagleserve.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _instruction(name: str) -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(rf"^{name}\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert match, f"Dockerfile has no exec-form {name}"
    return json.loads(match.group(1))


def test_hadolint_clean() -> None:
    exe = shutil.which("hadolint") or str(pathlib.Path(__file__).parents[1] / ".venv/bin/hadolint")
    proc = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_entrypoint_is_the_documented_cli() -> None:
    entry, cmd = _instruction("ENTRYPOINT"), _instruction("CMD")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry[0] == "eagleserve" and scripts["eagleserve"] == "eagleserve.cli:main"
    assert (
        entry[1] == "serve" and "--host" in entry and entry[entry.index("--host") + 1] == "0.0.0.0"
    )
    ns = build_parser().parse_args(entry[1:] + cmd)  # the CLI accepts exactly these arguments
    assert ns.command == "serve"
    readme = (ROOT / "README.md").read_text()
    assert "docker run --gpus all -p 8000:8000" in readme
    config = cmd[cmd.index("--config") + 1]
    assert (ROOT / config).exists(), f"CMD names {config}, which the image must contain"

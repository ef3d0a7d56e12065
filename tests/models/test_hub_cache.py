"""`--model org/name` (and a draft head's path) as a Hugging Face repo id, read from the local
hub cache as `hf download` leaves it (models/loader.py `hub_snapshot`): the snapshot that
refs/main names is the model, an engine on it makes the tokens the folder does, and a repo
that is not cached is an error that says how to get it (nothing is downloaded)."""

from __future__ import annotations

import os
import random
import shutil
import string
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import pytest

from eagleserve import Engine
from eagleserve.models.loader import resolve_draft_path, resolve_model_path
from eagleserve.sampling_params import SamplingParams


def name() -> str:
    return "".join(random.choices(string.ascii_lowercase, k=8))


def cache_repo(cache: Path, repo_id: str, src: str | None) -> Path:
    """`repo_id` in a hub cache: an older snapshot, and the one refs/main names (a copy of
    `src`, or a bare config.json)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    old, new = (repo / "snapshots" / f"{random.getrandbits(64):016x}" for _ in range(2))
    for snap in (old, new):
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
    if src is not None:
        shutil.copytree(src, new, dirs_exist_ok=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new.name)
    return new


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_a_cached_repo_is_its_snapshot(hub_cache: Path) -> None:
    model, head = f"{name()}/{name()}", f"{name()}/{name()}"
    want_model, want_head = cache_repo(hub_cache, model, None), cache_repo(hub_cache, head, None)
    assert resolve_model_path(model) == str(want_model)
    assert resolve_draft_path(head) == str(want_head)
    missing = f"{name()}/{name()}"
    for resolve in (resolve_model_path, resolve_draft_path):
        with pytest.raises(FileNotFoundError, match=f"hf download {missing}"):
            resolve(missing)
    with pytest.raises(FileNotFoundError) as exc:  # a path, no repo id: no hub hint
        resolve_model_path(f"{name()}/{name()}/{name()}")
    assert "hf download" not in str(exc.value)


def test_an_engine_on_a_cached_repo(
    hub_cache: Path, tiny_model_dir: str, make_engine: Callable[..., Engine]
) -> None:
    repo = f"{name()}/{name()}"
    cache_repo(hub_cache, repo, tiny_model_dir)
    prompts = [[random.randrange(3, 256) for _ in range(random.randint(2, 12))] for _ in range(3)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    want = make_engine(tiny_model_dir).generate(prompts, params)
    got = make_engine(repo).generate(prompts, params)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]


def test_serve_names_the_download(tmp_path: Path) -> None:
    repo = f"{name()}/{name()}"
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "eagleserve", "serve", "--model", repo, "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert proc.returncode == 2 and f"hf download {repo}" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr

"""Fixtures of the training tests."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny target with a ChatML template (the recipe renders whole conversations)."""
    path = str(tmp_path_factory.mktemp("chat_target"))
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path

"""The sampling tests' 8-token target (`small_target`: its path and transformers model), the
EAGLE head that drafts well on it (`head_dir`), the prompt, the sample count and the TV
threshold: test_eagle_sampling.py's, shared with test_grammar_sampling.py and
test_gpu_paths.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

VOCAB = 8
N_SAMPLES = 20_000
PROMPT = [1, 5, 2, 7]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LlamaForCausalLM]:
    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaky enough that drafts get accepted often
    path = str(tmp_path_factory.mktemp("small"))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def head_dir(small_target: tuple[str, LlamaForCausalLM], tmp_path_factory) -> str:
    path, _ = small_target
    runner = ModelRunner(
        ModelConfig.from_dir(path), path, torch.device("cpu"), torch.float32, 64, 1, 64
    )
    head = init_eagle_head("EAGLE", runner.model, seed=3)
    h = head.hidden_size
    with torch.no_grad():
        head.fc.weight[:, :h].add_(torch.eye(h))
    out = os.path.join(str(tmp_path_factory.mktemp("head")), "head")
    save_eagle_head(head, out)
    return out


def tv_threshold(joint: np.ndarray, n: int, rng: np.random.Generator) -> float:
    p = joint.ravel()
    tvs = [0.5 * np.abs(rng.multinomial(n, p) / n - p).sum() for _ in range(1000)]
    return float(np.quantile(tvs, 0.999))

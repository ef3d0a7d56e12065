"""A random two-layer Llama of 64 tokens (`model_dir`) and a random EAGLE head for it
(`head_dir`, made on DEVICE: the GPU where there is one), module-scoped: test_faults.py's
model and test_overlap_inputs.py's head, shared with test_warmup.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagleserve import Engine
from eagleserve.spec.head_loader import init_eagle_head, save_eagle_head

# On a GPU host the forward runs on its own stream there, where the hazard test_overlap_inputs.py
# checks is real.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=None,
    )
    path = str(tmp_path_factory.mktemp("fault-model"))
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def head_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random EAGLE head for the model."""
    eng = Engine(model=model_dir, device=DEVICE, max_total_tokens=256)
    head = init_eagle_head("EAGLE", eng.scheduler.worker.runner.model, seed=3)
    path = str(tmp_path_factory.mktemp("overlap-head"))
    save_eagle_head(head, path)
    return path

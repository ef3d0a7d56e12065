"""The small target and the published EAGLE/EAGLE3 head formats that tests/spec/test_eagle_head.py
and test_head_loader.py load: their fixtures (`target_dir`, `target`), the sizes they share,
and writers of head folders (config.json plus safetensors or pytorch_model.bin) as the
published checkpoints lay them out (head_reference.py: what a head's forward must give)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner
from eagleserve.models.llama import LlamaForCausalLM

H, V, N = 64, 96, 8  # target hidden, vocab, layers
NH, NKV, D, INTER = 4, 2, 16, 96  # head attention heads, kv heads, head_dim, mlp width
HEAD_THETA = 500000.0  # differs from the target's 10000: the head must use its own rope
CPU = torch.device("cpu")
T, SPLIT = 7, 4  # tokens in the check sequence; first paged forward covers [0, SPLIT)

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module", name="target_dir")
def target_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    path = str(tmp_path_factory.mktemp("target"))
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=N,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    HFLlama(cfg).save_pretrained(path)
    return path


def make_runner(path: str, aux: tuple[int, ...] = ()) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_dir(path),
        path,
        CPU,
        torch.float32,
        max_total_tokens=64,
        max_running_requests=2,
        max_context_len=64,
        attention_backend="torch",
        aux_layer_ids=aux,
    )


@pytest.fixture(scope="module", name="target")
def target_fixture(target_dir: str) -> LlamaForCausalLM:
    return make_runner(target_dir).model


# ---------------------------------------------------------------- writing published formats


def head_config(arch: str, **extra: object) -> dict:
    cfg = {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": HEAD_THETA,
        "max_position_embeddings": 128,
        "vocab_size": V,
    }
    cfg.update(extra)
    return cfg


def _layer_tensors(pre: str, in_size: int, gen: torch.Generator) -> Tensors:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    return {
        f"{pre}self_attn.q_proj.weight": r(NH * D, in_size),
        f"{pre}self_attn.k_proj.weight": r(NKV * D, in_size),
        f"{pre}self_attn.v_proj.weight": r(NKV * D, in_size),
        f"{pre}self_attn.o_proj.weight": r(H, NH * D),
        f"{pre}mlp.gate_proj.weight": r(INTER, H),
        f"{pre}mlp.up_proj.weight": r(INTER, H),
        f"{pre}mlp.down_proj.weight": r(H, INTER),
        f"{pre}post_attention_layernorm.weight": 1 + r(H),
    }


def eagle1_tensors(bias: bool, seed: int = 1) -> Tensors:
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=gen) * 0.1}
    if bias:
        t["fc.bias"] = torch.randn(H, generator=gen) * 0.1
    t.update(_layer_tensors("layers.0.", H, gen))
    return t


def eagle3_tensors(draft_ids: torch.Tensor, seed: int = 2) -> Tensors:
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 3 * H, generator=gen) * 0.1}
    t.update(_layer_tensors("midlayer.", 2 * H, gen))
    for name in ("midlayer.hidden_norm", "midlayer.input_layernorm", "norm"):
        t[f"{name}.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    t["lm_head.weight"] = torch.randn(len(draft_ids), H, generator=gen) * 0.1
    t["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    t["t2d"] = t2d
    return t


def upper_layer_tensors(layer: int, seed: int) -> Tensors:
    """Layer `layer` >= 1 of a multi-layer EAGLE3 head as vLLM names it: a plain decoder layer."""
    gen = torch.Generator().manual_seed(seed)
    t = _layer_tensors(f"layers.{layer}.", H, gen)
    t[f"layers.{layer}.input_layernorm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    return t


def write_head(path: str, cfg: dict, tensors: Tensors, fmt: str = "safetensors") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if fmt == "bin":
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


# A reduced draft vocabulary (sorted target ids, as d2t maps them).
DRAFT_IDS = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40]))


def eagle3_case(case: str) -> tuple[dict, Tensors, tuple[int, ...], torch.Tensor]:
    """An EAGLE-3 head folder's (config, tensors), its aux layer ids and draft vocabulary."""
    if case == "reduced_vocab_d2t":  # default aux layers {2, N//2, N-3}
        cfg = head_config("LlamaForCausalLMEagle3", draft_vocab_size=len(DRAFT_IDS))
        return cfg, eagle3_tensors(DRAFT_IDS), (2, 4, 5), DRAFT_IDS
    # Full vocab, explicit aux ids, no d2t/t2d, an (ignored) embed_tokens copy.
    cfg = head_config(
        "LlamaForCausalLMEagle3",
        draft_vocab_size=V,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]},
    )
    t = eagle3_tensors(torch.arange(V))
    del t["d2t"], t["t2d"]
    t["embed_tokens.weight"] = torch.randn(V, H)
    return cfg, t, (1, 4, 7), torch.arange(V)

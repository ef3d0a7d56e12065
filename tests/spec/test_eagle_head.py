"""EAGLE/EAGLE3 heads: published checkpoint formats load and their paged forward matches a dense
plain-torch re-implementation (test_head_loader.py: errors, save and load)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import forward_tokens
from eagle_head_formats import (  # noqa: F401 (fixtures)
    CPU,
    SPLIT,
    D,
    H,
    T,
    Tensors,
    V,
    eagle1_tensors,
    eagle3_case,
    head_config,
    make_runner,
    target_dir_fixture,
    target_fixture,
    write_head,
)
from head_reference import head_inputs, paged_forward, ref_eagle1, ref_eagle3

from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head

# ---------------------------------------------------------------- EAGLE-1/2


EAGLE1_CASES: dict[str, Callable[[], tuple[dict, Tensors, str]]] = {
    "bias_true": lambda: (
        head_config("LlamaForCausalLMEagle", bias=True),
        eagle1_tensors(True),
        "safetensors",
    ),
    "no_bias_key": lambda: (head_config("LlamaForCausalLMEagle"), eagle1_tensors(True), "bin"),
    "bias_false_model_prefix": lambda: (
        head_config("LlamaForCausalLMEagle", bias=False),
        {"model." + k: v for k, v in eagle1_tensors(False).items()},
        "safetensors",
    ),
    # The reference repo: plain one-layer LlamaForCausalLM config, .bin with extra buffers.
    "reference_repo": lambda: (
        head_config("LlamaForCausalLM"),
        {
            **eagle1_tensors(True),
            "embed_tokens.weight": torch.randn(V, H),
            "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(D // 2),
        },
        "bin",
    ),
}


@pytest.mark.parametrize("case", list(EAGLE1_CASES))
def test_eagle1_formats_match_reference(case: str, tmp_path, target: LlamaForCausalLM) -> None:
    cfg, tensors, fmt = EAGLE1_CASES[case]()
    head = load_eagle_head(
        write_head(str(tmp_path), cfg, tensors, fmt), "EAGLE", target, CPU, torch.float32
    )
    w = {k.removeprefix("model."): v for k, v in tensors.items()}
    assert (head.algorithm, head.feature_size, head.aux_layer_ids) == ("EAGLE", H, ())
    assert head.draft_vocab_size == V and head.fc_bias == ("fc.bias" in w)
    ids, feats = head_inputs(H, H)
    logits, nxt = paged_forward(head, ids, feats)
    ref_logits, ref_next = ref_eagle1(w, target, ids, torch.cat(feats))
    assert logits.dtype == torch.float32 and logits.shape == (T, V)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt, ref_next, atol=1e-5, rtol=1e-5)
    assert torch.equal(head.to_target_ids(ids), ids)


# ---------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("case", ["reduced_vocab_d2t", "aux_ids_full_vocab"])
def test_eagle3_formats_match_reference(case: str, tmp_path, target: LlamaForCausalLM) -> None:
    cfg, tensors, aux, draft_ids = eagle3_case(case)
    head = load_eagle_head(
        write_head(str(tmp_path), cfg, tensors), "eagle3", target, CPU, torch.float32
    )
    assert head.algorithm == "EAGLE3" and head.aux_layer_ids == aux
    assert head.feature_size == 3 * H and head.draft_vocab_size == len(draft_ids)
    assert torch.equal(head.to_target_ids(torch.arange(len(draft_ids))), draft_ids)
    ids, feats = head_inputs(3 * H, H)  # target features, then fed-back draft features
    logits, nxt = paged_forward(head, ids, feats)
    ref_logits, ref_next = ref_eagle3(tensors, target, ids, feats)
    assert logits.dtype == torch.float32 and logits.shape == (T, len(draft_ids))
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt, ref_next, atol=1e-5, rtol=1e-5)


def test_target_aux_features_fit_head(target_dir: str, target: LlamaForCausalLM) -> None:
    head = init_eagle_head("EAGLE3", target, draft_vocab_size=32)
    runner = make_runner(target_dir, head.aux_layer_ids)
    ids = torch.arange(5)
    loc = runner.token_to_kv_pool.alloc(5)
    runner.req_to_token_pool.req_to_token[0, :5] = loc
    out = forward_tokens(
        runner,
        "extend",
        ids,
        torch.arange(5),
        loc,
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([5]),
    )
    assert out.aux_hidden_states.shape == (5, head.feature_size)
    logits, nxt = paged_forward(
        head, torch.arange(T), [out.aux_hidden_states[:SPLIT], torch.randn(T - SPLIT, H)]
    )
    assert logits.shape == (T, 32) and nxt.shape == (T, H) and torch.isfinite(logits).all()

"""EAGLE/EAGLE3 head files (spec/head_loader.py): a bad checkpoint's error names the tensor, and
save -> load round-trips exactly (whole or sharded), for loaded and freshly initialized heads."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_head_formats import (  # noqa: F401 (fixtures)
    CPU,
    DRAFT_IDS,
    NH,
    D,
    H,
    Tensors,
    V,
    eagle1_tensors,
    eagle3_case,
    eagle3_tensors,
    head_config,
    target_dir_fixture,
    target_fixture,
    write_head,
)
from head_reference import reloaded, roundtrip

from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head, save_eagle_head

# ---------------------------------------------------------------- errors


def _load_err(
    tmp_path,
    cfg: dict,
    tensors: Tensors,
    algo: str,
    target: LlamaForCausalLM,
    exc: type[Exception],
    match: str,
) -> None:
    path = write_head(str(tmp_path), cfg, tensors)
    with pytest.raises(exc, match=match) as info:
        load_eagle_head(path, algo, target, CPU, torch.float32)
    assert path in str(info.value) or "hidden_size" in str(info.value)


def test_errors_name_the_tensor(tmp_path, target: LlamaForCausalLM) -> None:
    eagle = head_config("LlamaForCausalLMEagle")
    t = eagle1_tensors(True)
    t["layers.0.self_attn.q_proj.weight"] = torch.randn(NH * D, H + 1)
    _load_err(tmp_path / "a", eagle, t, "EAGLE", target, ValueError, r"q_proj\.weight.*shape")
    t = eagle1_tensors(True)
    del t["layers.0.mlp.up_proj.weight"]
    _load_err(tmp_path / "b", eagle, t, "EAGLE", target, KeyError, r"up_proj\.weight")
    # No `bias` key means bias: true, so the bias tensor is required, never random.
    _load_err(
        tmp_path / "c",
        eagle,
        eagle1_tensors(False),
        "EAGLE",
        target,
        KeyError,
        r"fc\.bias.*no 'bias' key",
    )
    _load_err(
        tmp_path / "d",
        {**eagle, "bias": True},
        eagle1_tensors(False),
        "EAGLE",
        target,
        KeyError,
        r"fc\.bias",
    )
    _load_err(
        tmp_path / "e",
        {**eagle, "bias": False},
        eagle1_tensors(True),
        "EAGLE",
        target,
        KeyError,
        r"unexpected tensor 'fc\.bias'",
    )
    _load_err(
        tmp_path / "f",
        {**eagle, "hidden_size": 2 * H},
        eagle1_tensors(True),
        "EAGLE",
        target,
        ValueError,
        "hidden_size",
    )
    e3 = head_config("LlamaForCausalLMEagle3", draft_vocab_size=len(DRAFT_IDS))
    t = eagle3_tensors(DRAFT_IDS)
    del t["d2t"]
    _load_err(tmp_path / "g", e3, t, "EAGLE3", target, KeyError, "d2t")
    t = eagle3_tensors(DRAFT_IDS)
    t["embed_tokens.weight"] = torch.randn(V + 1, H)
    _load_err(tmp_path / "h", e3, t, "EAGLE3", target, ValueError, r"embed_tokens\.weight")
    _load_err(tmp_path / "i", e3, eagle3_tensors(DRAFT_IDS), "EAGLE", target, ValueError, "EAGLE3")


# ---------------------------------------------------------------- save / load / init


def test_save_loadroundtrip(tmp_path, target: LlamaForCausalLM) -> None:
    cfg, tensors = head_config("LlamaForCausalLMEagle"), eagle1_tensors(True)
    loaded = load_eagle_head(
        write_head(str(tmp_path / "e1"), cfg, tensors), "EAGLE", target, CPU, torch.float32
    )
    roundtrip(loaded, tmp_path / "e1_out", target)
    cfg, tensors, _, _ = eagle3_case("reduced_vocab_d2t")
    loaded = load_eagle_head(
        write_head(str(tmp_path / "e3"), cfg, tensors), "EAGLE3", target, CPU, torch.float32
    )
    roundtrip(loaded, tmp_path / "e3_out", target)
    with open(tmp_path / "e3_out" / "config.json") as f:
        saved = json.load(f)
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    roundtrip(init_eagle_head("EAGLE", target, seed=1), tmp_path / "i1", target)


def test_init_eagle3_draft_token_ids(tmp_path, target: LlamaForCausalLM) -> None:
    ids = DRAFT_IDS[torch.randperm(len(DRAFT_IDS))]  # unsorted input: the head sorts it
    head = init_eagle_head("EAGLE3", target, draft_token_ids=ids, seed=4)
    assert head.draft_vocab_size == len(DRAFT_IDS) and head.aux_layer_ids == (2, 4, 5)
    assert torch.equal(head.to_target_ids(torch.arange(len(DRAFT_IDS))), DRAFT_IDS)
    assert torch.equal(head.lm_head.weight, target.lm_head_weight[DRAFT_IDS])
    same = init_eagle_head("EAGLE3", target, draft_token_ids=DRAFT_IDS, seed=4)
    assert all(
        torch.equal(a, b)
        for a, b in zip(head.state_dict().values(), same.state_dict().values(), strict=True)
    )
    again = roundtrip(head, tmp_path, target)
    assert torch.equal(again.d2t, head.d2t)
    full = init_eagle_head("EAGLE3", target)
    assert torch.equal(full.to_target_ids(torch.arange(V)), torch.arange(V))


def test_sharded_save_loads_as_one(tmp_path, target: LlamaForCausalLM) -> None:
    """A head saved in files of at most `limit` tensor bytes (a larger tensor alone in its
    file) loads as the same head, drafting the same logits; a later unsharded save into the
    same folder replaces the shards, so no tensor is found twice."""
    from safetensors import safe_open

    cfg, tensors, _, _ = eagle3_case("reduced_vocab_d2t")
    path = write_head(str(tmp_path / "e3"), cfg, tensors)
    head = load_eagle_head(path, "EAGLE3", target, CPU, torch.float32)
    limit = 24_000
    out = tmp_path / "sharded"
    save_eagle_head(head, str(out), max_shard_bytes=limit)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) >= 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            sizes = [sf.get_tensor(k).nbytes for k in sf.keys()]
            assert all(index["weight_map"][k] == f.name for k in sf.keys())
        assert sum(sizes) <= limit or len(sizes) == 1, (f.name, sizes)
    again = reloaded(head, str(out), target)
    save_eagle_head(again, str(out))  # unsharded now: the shards and their index go
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    reloaded(head, str(out), target)


def test_a_frozen_vocab_map_maps_draft_ids_as_d2t_does(target: LlamaForCausalLM) -> None:
    """Serving maps draft ids through one table (`freeze_vocab_map`): the target ids of random
    draft ids, any shape, are those `d2t` gives."""
    ids = DRAFT_IDS[torch.randperm(len(DRAFT_IDS))]
    head = init_eagle_head("EAGLE3", target, draft_token_ids=ids, seed=5)
    draft = torch.randint(0, head.draft_vocab_size, (7, 3))
    want = head.to_target_ids(draft)
    assert torch.equal(want, draft + head.d2t[draft]) and not torch.equal(want, draft)
    head.freeze_vocab_map()
    assert head.target_ids is not None
    assert torch.equal(head.to_target_ids(draft), want)

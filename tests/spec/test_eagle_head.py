"""EAGLE/EAGLE3 heads: published checkpoint formats load, errors name the tensor, the paged forward
matches a dense plain-torch re-implementation, and save -> load round-trips exactly."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
import torch
from conftest import forward_tokens, make_forward_batch
from eagle_head_formats import (  # noqa: F401 (fixtures)
    CPU,
    HEAD_THETA,
    INTER,
    NH,
    NKV,
    SPLIT,
    D,
    H,
    N,
    T,
    Tensors,
    V,
    eagle1_tensors,
    eagle3_tensors,
    head_config,
    make_runner,
    target_dir_fixture,
    target_fixture,
    write_head,
)

from eagleserve.layers.attention import TorchAttnBackend
from eagleserve.layers.forward_batch import forward_context
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head, save_eagle_head

# ---------------------------------------------------------------- dense reference


def ref_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def ref_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]
    inv = 1.0 / HEAD_THETA ** (torch.arange(0, D, 2).float() / D)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    rot = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), -1)
    return x * cos + rot * sin


def ref_layer_attn(w: Tensors, pre: str, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Dense causal GQA attention over one sequence; x [T, in]."""
    n = x.shape[0]
    q = ref_rope((x @ w[pre + "self_attn.q_proj.weight"].T).view(n, NH, D), pos)
    k = ref_rope((x @ w[pre + "self_attn.k_proj.weight"].T).view(n, NKV, D), pos)
    v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(n, NKV, D)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, NH * D)
    return out @ w[pre + "self_attn.o_proj.weight"].T


def ref_mlp(w: Tensors, pre: str, x: torch.Tensor) -> torch.Tensor:
    g = torch.nn.functional.silu(x @ w[pre + "mlp.gate_proj.weight"].T)
    return (g * (x @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T


def ref_eagle1(w: Tensors, tgt: LlamaForCausalLM, ids: torch.Tensor, feats: torch.Tensor) -> tuple:
    pos = torch.arange(len(ids))
    x = torch.cat((tgt.model.embed_tokens.weight[ids], feats), -1) @ w["fc.weight"].T
    x = x + w["fc.bias"] if "fc.bias" in w else x
    x = x + ref_layer_attn(w, "layers.0.", x, pos)
    out = x + ref_mlp(w, "layers.0.", ref_rms(x, w["layers.0.post_attention_layernorm.weight"]))
    return out @ tgt.lm_head_weight.T, out


def ref_eagle3(w: Tensors, tgt: LlamaForCausalLM, ids: torch.Tensor, feats: list) -> tuple:
    """feats: per-row 3h target features or h-wide fed-back features."""
    pos = torch.arange(len(ids))
    g = torch.cat([f @ w["fc.weight"].T if f.shape[-1] == 3 * H else f for f in feats])
    emb = ref_rms(tgt.model.embed_tokens.weight[ids], w["midlayer.input_layernorm.weight"])
    x_in = torch.cat((emb, ref_rms(g, w["midlayer.hidden_norm.weight"])), -1)
    x = g + ref_layer_attn(w, "midlayer.", x_in, pos)
    out = x + ref_mlp(w, "midlayer.", ref_rms(x, w["midlayer.post_attention_layernorm.weight"]))
    i = 1
    while f"layers.{i}.input_layernorm.weight" in w:  # vLLM's further layers: plain Llama ones
        pre = f"layers.{i}."
        x = out + ref_layer_attn(w, pre, ref_rms(out, w[pre + "input_layernorm.weight"]), pos)
        out = x + ref_mlp(w, pre, ref_rms(x, w[pre + "post_attention_layernorm.weight"]))
        i += 1
    return ref_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


def paged_forward(head: EagleHead, ids: torch.Tensor, feats: list) -> tuple:
    """Two paged extends over one draft KV pool: [0, SPLIT) then [SPLIT, T)."""
    cfg = head.config
    pool = TokenToKVPool(32, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         torch.float32, CPU)  # fmt: skip
    r2t = ReqToTokenPool(1, 64, CPU)
    backend = TorchAttnBackend(r2t.req_to_token, cfg.head_dim**-0.5)
    loc = pool.alloc(len(ids))
    r2t.req_to_token[0, : len(ids)] = loc
    outs = []
    for (a, b), f in zip(((0, SPLIT), (SPLIT, len(ids))), feats, strict=True):
        fb = make_forward_batch(
            mode="extend",
            input_ids=ids[a:b],
            positions=torch.arange(a, b),
            out_cache_loc=loc[a:b],
            req_pool_indices=torch.tensor([0]),
            prefix_lens=torch.tensor([a]),
            extend_lens=torch.tensor([b - a]),
            kv_pool=pool,
            attn_backend=backend,
        )
        with torch.no_grad(), forward_context(fb):
            outs.append(head(ids[a:b], f, fb.positions))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _inputs(width_first: int, width_second: int) -> tuple[torch.Tensor, list]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (T,), generator=gen)
    return ids, [
        torch.randn(SPLIT, width_first, generator=gen),
        torch.randn(T - SPLIT, width_second, generator=gen),
    ]


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
    ids, feats = _inputs(H, H)
    logits, nxt = paged_forward(head, ids, feats)
    ref_logits, ref_next = ref_eagle1(w, target, ids, torch.cat(feats))
    assert logits.dtype == torch.float32 and logits.shape == (T, V)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt, ref_next, atol=1e-5, rtol=1e-5)
    assert torch.equal(head.to_target_ids(ids), ids)


# ---------------------------------------------------------------- EAGLE-3

DRAFT_IDS = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40]))


def _eagle3_case(case: str) -> tuple[dict, Tensors, tuple[int, ...], torch.Tensor]:
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


@pytest.mark.parametrize("case", ["reduced_vocab_d2t", "aux_ids_full_vocab"])
def test_eagle3_formats_match_reference(case: str, tmp_path, target: LlamaForCausalLM) -> None:
    cfg, tensors, aux, draft_ids = _eagle3_case(case)
    head = load_eagle_head(
        write_head(str(tmp_path), cfg, tensors), "eagle3", target, CPU, torch.float32
    )
    assert head.algorithm == "EAGLE3" and head.aux_layer_ids == aux
    assert head.feature_size == 3 * H and head.draft_vocab_size == len(draft_ids)
    assert torch.equal(head.to_target_ids(torch.arange(len(draft_ids))), draft_ids)
    ids, feats = _inputs(3 * H, H)  # target features, then fed-back draft features
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


def _roundtrip(head: EagleHead, tmp_path, target: LlamaForCausalLM) -> EagleHead:
    save_eagle_head(head, str(tmp_path))
    again = load_eagle_head(str(tmp_path), head.algorithm, target, CPU, torch.float32)
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for attr in ("aux_layer_ids", "feature_size", "draft_vocab_size", "fc_bias", "config"):
        assert getattr(head, attr) == getattr(again, attr), attr
    width = head.feature_size
    ids, feats = _inputs(width, H)
    for x, y in zip(paged_forward(head, ids, feats), paged_forward(again, ids, feats), strict=True):
        assert torch.equal(x, y)
    return again


def test_save_load_roundtrip(tmp_path, target: LlamaForCausalLM) -> None:
    cfg, tensors, _ = EAGLE1_CASES["no_bias_key"]()
    loaded = load_eagle_head(
        write_head(str(tmp_path / "e1"), cfg, tensors), "EAGLE", target, CPU, torch.float32
    )
    _roundtrip(loaded, tmp_path / "e1_out", target)
    cfg, tensors, _, _ = _eagle3_case("reduced_vocab_d2t")
    loaded = load_eagle_head(
        write_head(str(tmp_path / "e3"), cfg, tensors), "EAGLE3", target, CPU, torch.float32
    )
    _roundtrip(loaded, tmp_path / "e3_out", target)
    with open(tmp_path / "e3_out" / "config.json") as f:
        saved = json.load(f)
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    _roundtrip(init_eagle_head("EAGLE", target, seed=1), tmp_path / "i1", target)


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
    again = _roundtrip(head, tmp_path, target)
    assert torch.equal(again.d2t, head.d2t)
    full = init_eagle_head("EAGLE3", target)
    assert torch.equal(full.to_target_ids(torch.arange(V)), torch.arange(V))


def test_sharded_save_loads_as_one(tmp_path, target: LlamaForCausalLM) -> None:
    """A head saved in files of at most `limit` tensor bytes (a larger tensor alone in its
    file) loads as the same head, drafting the same logits; a later unsharded save into the
    same folder replaces the shards, so no tensor is found twice."""
    from safetensors import safe_open

    cfg, tensors, _, _ = _eagle3_case("reduced_vocab_d2t")
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
    again = _roundtrip_from(head, str(out), target)
    save_eagle_head(again, str(out))  # unsharded now: the shards and their index go
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    _roundtrip_from(head, str(out), target)


def _roundtrip_from(head: EagleHead, path: str, target: LlamaForCausalLM) -> EagleHead:
    again = load_eagle_head(path, head.algorithm, target, CPU, torch.float32)
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids, feats = _inputs(head.feature_size, H)
    for x, y in zip(paged_forward(head, ids, feats), paged_forward(again, ids, feats), strict=True):
        assert torch.equal(x, y)
    return again


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

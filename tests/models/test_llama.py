"""eagleserve's Llama forward gives the logits of transformers' own implementation.

Both run the same weights in fp32. eagleserve runs through `ModelRunner.forward` with a paged
layout: several requests in one forward, their KV slots scattered over the pool in random order
and interleaved with each other, request-pool rows that are not 0, a prefill split into two
chunks (the second one attends to a cached prefix), then decode steps of the whole batch.
transformers runs each request alone with its own KV cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import forward_tokens
from transformers import AutoModelForCausalLM

from eagleserve.config import ModelConfig
from eagleserve.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("torch_threads")

REL_TOL = 1e-4
DECODE_STEPS = 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def hf_logits(
    model: torch.nn.Module, prompt: list[int], decode_ids: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers with its own cache: prefill logits [n, V], then one [V] per decode token."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        prefill = out.logits[0].float()
        cache = out.past_key_values
        steps = []
        for tok in decode_ids:
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1].float())
    return prefill, steps


def check_paged_parity(model_dir: str, vocab: int, lengths: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    decode = [torch.randint(3, vocab, (DECODE_STEPS,), generator=g).tolist() for _ in lengths]
    bs = len(prompts)

    cfg = ModelConfig.from_dir(model_dir)
    total = sum(lengths) + bs * DECODE_STEPS
    kv_tokens = total + 37
    max_ctx = max(lengths) + DECODE_STEPS + 8
    runner = ModelRunner(
        cfg, model_dir, torch.device("cpu"), torch.float32, kv_tokens, bs + 3, max_ctx, "torch"
    )
    # Paged layout: request-pool rows 1, 3, 5, ...; every position gets a random free KV slot, so
    # one request's positions are scattered and interleaved with the other requests' ones.
    pool_rows = [1 + 2 * i for i in range(bs)]
    slots = (torch.randperm(kv_tokens, generator=g) + 1)[:total]
    start = 0
    for row, n in zip(pool_rows, lengths, strict=True):
        runner.req_to_token_pool.req_to_token[row, : n + DECODE_STEPS] = slots[
            start : start + n + DECODE_STEPS
        ]
        start += n + DECODE_STEPS
    r2t = runner.req_to_token_pool.req_to_token
    rows = torch.tensor(pool_rows)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = [hf_logits(hf, p, d) for p, d in zip(prompts, decode, strict=True)]

    # Prefill in two chunks: the first `cut` tokens, then the rest on top of the cached prefix.
    cuts = [max(1, n // 3) for n in lengths]
    got_prefill: list[list[torch.Tensor]] = [[] for _ in range(bs)]
    for lo_of, hi_of in ((lambda i: 0, lambda i: cuts[i]), (lambda i: cuts[i], lambda i: None)):
        lo = [lo_of(i) for i in range(bs)]
        hi = [hi_of(i) if hi_of(i) is not None else lengths[i] for i in range(bs)]
        ext = [h - lo_i for lo_i, h in zip(lo, hi, strict=True)]
        out = forward_tokens(
            runner,
            "extend",
            input_ids=torch.tensor(
                [t for p, a, b in zip(prompts, lo, hi, strict=True) for t in p[a:b]]
            ),
            positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi, strict=True)]),
            out_cache_loc=torch.cat(
                [r2t[r, a:b] for r, a, b in zip(pool_rows, lo, hi, strict=True)]
            ),
            req_pool_indices=rows,
            prefix_lens=torch.tensor(lo),
            extend_lens=torch.tensor(ext),
        )
        assert out.logits.dtype == torch.float32
        for i, chunk in enumerate(out.logits.split(ext)):
            got_prefill[i].append(chunk)
    for i in range(bs):
        got = torch.cat(got_prefill[i])
        assert got.shape == ref[i][0].shape
        err = rel_err(got, ref[i][0])
        assert err < REL_TOL, f"prefill logits of request {i}: relative error {err:.2e}"

    seq = torch.tensor(lengths)
    for step in range(DECODE_STEPS):
        out = forward_tokens(
            runner,
            "decode",
            input_ids=torch.tensor([d[step] for d in decode]),
            positions=seq.clone(),
            out_cache_loc=r2t[rows, seq],
            req_pool_indices=rows,
            prefix_lens=seq.clone(),
            extend_lens=torch.ones(bs, dtype=torch.long),
        )
        seq = seq + 1
        for i in range(bs):
            want = ref[i][1][step]
            err = rel_err(out.logits[i], want)
            assert err < REL_TOL, f"decode step {step}, request {i}: relative error {err:.2e}"
            # Greedy tokens agree too (the property users see), unless a near tie.
            top2 = want.topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:
                assert int(out.logits[i].argmax()) == int(want.argmax())


def test_tiny_llama_matches_transformers(tiny_model_dir: str) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    # The properties this config is meant to exercise really are present.
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert not cfg.tie_word_embeddings
    assert cfg.rope_scaling_dict is not None and cfg.rope_scaling_dict["factor"] == 8.0
    check_paged_parity(tiny_model_dir, cfg.vocab_size, [29, 7, 50], seed=11)


def test_tiny_qwen2_with_bias_matches_transformers(tiny_qwen2_dir: str) -> None:
    cfg = ModelConfig.from_dir(tiny_qwen2_dir)
    assert cfg.attention_bias
    check_paged_parity(tiny_qwen2_dir, cfg.vocab_size, [13, 40], seed=12)


def test_smollm2_matches_transformers(smollm2_dir: str) -> None:
    cfg = ModelConfig.from_dir(smollm2_dir)
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 30
    check_paged_parity(smollm2_dir, cfg.vocab_size, [21, 9], seed=13)


def test_parity_check_detects_wrong_rope(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parity check can fail: dropping the Llama-3 rope scaling must break it."""
    orig = ModelConfig.from_dir

    def no_scaling(path: str) -> ModelConfig:
        from dataclasses import replace

        return replace(orig(path), rope_scaling=None)

    monkeypatch.setattr(ModelConfig, "from_dir", staticmethod(no_scaling))
    with pytest.raises(AssertionError, match="relative error"):
        check_paged_parity(tiny_model_dir, 256, [29, 7], seed=14)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fused_norm_and_bound_rotary_are_bit_identical_to_reference(rows: int) -> None:
    """The per-step shortcuts (fused rms_norm; cos/sin looked up once per forward, rotate_half as
    a roll times a pre-signed sin) compute exactly the reference formulas, bit for bit."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from eagleserve.models.llama import RMSNorm, RotaryEmbedding

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen) * 3
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(norm(x), ref)

    cfg = ModelConfig(
        vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    rope = RotaryEmbedding(cfg, 512)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    q = torch.randn(rows, 4, 16, generator=gen)
    k = torch.randn(rows, 2, 16, generator=gen)
    got_q, got_k = rope.at(positions, q.dtype)(positions, q, k)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [rows, 16], as transformers builds it
    ref_q, ref_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)

"""--enable-deterministic-inference at load: which attention backend a device gets, and the
model's linears and norms switched to the batch-invariant kernels (same parameters)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from eagleserve.config import ModelConfig  # noqa: E402
from eagleserve.layers.attention import TorchAttnBackend, create_attn_backend  # noqa: E402
from eagleserve.layers.triton_backend import TritonAttnBackend  # noqa: E402
from eagleserve.models.batch_invariant import (  # noqa: E402
    BatchInvariantLinear,
    BatchInvariantRMSNorm,
    make_batch_invariant,
)
from eagleserve.models.llama import LlamaForCausalLM  # noqa: E402


def test_backend_choice() -> None:
    r2t = torch.zeros(2, 8, dtype=torch.long)
    gpu = torch.device("cuda")
    be = create_attn_backend("auto", gpu, r2t, 0.1, deterministic=True)
    assert isinstance(be, TritonAttnBackend) and be.deterministic
    # A packed (shape-invariant) target may run the mode on Triton too.
    be = create_attn_backend("triton", gpu, r2t, 0.1, shape_invariant=True, deterministic=True)
    assert be.deterministic
    with pytest.raises(ValueError, match="triton"):
        create_attn_backend("torch", gpu, r2t, 0.1, deterministic=True)
    cpu = create_attn_backend("auto", torch.device("cpu"), r2t, 0.1, deterministic=True)
    assert isinstance(cpu, TorchAttnBackend) and cpu.compute_dtype == torch.float64
    assert not create_attn_backend("triton", gpu, r2t, 0.1).deterministic


def test_triton_on_a_cpu_without_the_interpreter_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not an engine's internal error at the first request (Triton finds no GPU driver)."""
    r2t = torch.zeros(2, 8, dtype=torch.long)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on a GPU.*TRITON_INTERPRET=1"):
        create_attn_backend("triton", torch.device("cpu"), r2t, 0.1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(create_attn_backend("triton", torch.device("cpu"), r2t, 0.1),
                      TritonAttnBackend)  # fmt: skip


def test_make_batch_invariant_keeps_weights_and_matches_linear() -> None:
    """On a GPU host on the GPU: its Triton kernels run there for real, not on CPU tensors."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, tie_word_embeddings=True, head_dim=8,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, 64)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.to(dev)
    down = model.model.layers[1].mlp.down_proj
    w = down.weight
    x = torch.randn(5, 64, device=dev)
    want = down(x)
    # 2 layers x (4 attention + 3 MLP linears + 2 norms) + the final norm.
    assert make_batch_invariant(model) == 2 * 9 + 1
    assert type(down) is BatchInvariantLinear and down.weight is w
    assert type(model.model.norm) is BatchInvariantRMSNorm and model.batch_invariant
    torch.testing.assert_close(down(x), want, atol=1e-4, rtol=1e-4)
    h = torch.randn(3, 32, device=dev)
    torch.testing.assert_close(
        model.compute_logits(h), h @ model.model.embed_tokens.weight.T, atol=1e-4, rtol=1e-4
    )


def test_verify_rows_equal_their_decodes_on_the_fused_kernels(tiny_model_dir: str) -> None:
    """The mode on a GPU's path (the fused layers, the GEMV kernels at every size; here under
    the interpreter), bf16: a request's 4 verify rows give, bit for bit, the logits and hidden
    states of decoding those tokens one at a time, beside another request in both cases, and
    the K/V they leave in the cache is the same. (Under the interpreter, numpy's dot products
    do not depend on the batch either way, so a CPU run checks the wiring; a GPU's, the bits.)"""
    from conftest import forward_tokens

    from eagleserve.model_executor.model_runner import ModelRunner
    from eagleserve.models.fused_forward import merge_projections, use_gemv

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def fresh() -> ModelRunner:
        r = ModelRunner(ModelConfig.from_dir(tiny_model_dir), tiny_model_dir, dev,
                        torch.bfloat16, 96, 4, 64, "triton", deterministic=True)  # fmt: skip
        if not r.model.fused_kernels:  # a CPU host: set up as the runner does on a GPU
            merge_projections(r.model)
            make_batch_invariant(r.model)
            r.model.fused_kernels = True
        assert use_gemv(r.model, 40, torch.bfloat16)
        return r

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    lens, n = [7, 4], 4
    prompt = torch.randint(3, 256, (sum(lens),), generator=gen)
    tokens = torch.randint(3, 256, (2, n), generator=gen)  # A's and B's next n tokens
    slots = (torch.randperm(95, generator=gen) + 1)[:32].view(2, 16)
    rows = torch.tensor([3, 1])

    def run(r: ModelRunner, mode: str, ids: torch.Tensor, prefix: list[int], ext: list[int]):  # noqa: ANN202
        spans = list(zip(prefix, ext, strict=True))
        pos = torch.cat([torch.arange(p, p + e) for p, e in spans])
        loc = torch.cat([slots[i, p : p + e] for i, (p, e) in enumerate(spans)])
        return forward_tokens(
            r, mode, ids.to(dev), pos.to(dev), loc.to(dev), rows.to(dev),  # type: ignore[arg-type]
            torch.tensor(prefix, device=dev), torch.tensor(ext, device=dev),
        )  # fmt: skip

    outs = []
    for verify in (False, True):
        r = fresh()
        r.req_to_token_pool.req_to_token[rows, :16] = slots.to(dev)
        run(r, "extend", prompt, [0, 0], lens)
        if verify:
            out = run(r, "verify", tokens.flatten(), lens, [n, n])
            logits, hidden = out.logits.view(2, n, -1)[0], out.hidden_states.view(2, n, -1)[0]
        else:
            steps = [run(r, "decode", tokens[:, j], [m + j for m in lens], [1, 1])
                     for j in range(n)]  # fmt: skip
            logits = torch.stack([o.logits[0] for o in steps])
            hidden = torch.stack([o.hidden_states[0] for o in steps])
        pool, a_slots = r.token_to_kv_pool, slots[0, : lens[0] + n].to(dev)
        kv = torch.stack([b[a_slots] for b in pool.k_buffer + pool.v_buffer])
        outs.append((logits, hidden, kv))
    (want_logits, want_hidden, want_kv), (got_logits, got_hidden, got_kv) = outs
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_hidden, want_hidden)
    assert torch.equal(got_kv, want_kv)

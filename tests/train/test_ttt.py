"""The unrolled head's depth >= 1 attention: the masked-SDPA form and the causal-SDPA-plus-chain
merge (also over a past padded to one length, as a compiled step runs it) compute what the dense
form computes (outputs and gradients), for EAGLE and EAGLE3 heads, over several depths."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagleserve.spec.head_loader import init_eagle_head
from eagleserve.train.target import load_target
from eagleserve.train.ttt import chain_mask, head_step, padded_chain

pytestmark = pytest.mark.usefixtures("torch_threads")


def test_chain_mask_sees_context_and_own_chain() -> None:
    t, n = 5, 2
    m = chain_mask(t, n, torch.device("cpu"))
    assert m.shape == (t, (1 + n) * t)
    for j in range(t):
        seen = m[j].nonzero().flatten().tolist()
        assert seen == list(range(j + 1)) + [t + j, 2 * t + j]


@pytest.mark.parametrize("impl", ["sdpa", "merge", "merge-padded"])
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "EAGLE3-2layers"])
def test_chain_forms_equal_dense(tiny_model_dir: str, algorithm: str, impl: str) -> None:
    target, _ = load_target(tiny_model_dir, "float32", 64)
    layers = 2 if algorithm.endswith("2layers") else 1
    head = init_eagle_head(algorithm.removesuffix("-2layers"), target, num_hidden_layers=layers,
                           seed=int(torch.randint(0, 1000, ())))  # fmt: skip
    b, t, depths = 3, 11, 4
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    vocab = target.config.vocab_size
    x = torch.randint(0, vocab, (b, t + depths), generator=g)
    feats0 = torch.randn(b, t, head.feature_size, generator=g, requires_grad=True)

    def unroll(impl: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        past: list[list] = [[] for _ in range(layers)]
        feats, total = feats0, torch.zeros(())
        outs = []
        for s in range(depths):
            pos = (torch.arange(t) + s).expand(b, t)
            seen, valid = past, None
            if impl == "merge-padded" and s:
                padded = [padded_chain(p, depths - 1) for p in past]
                seen, valid = [p for p, _ in padded], padded[0][1]
            form = impl.removesuffix("-padded")
            hid, out, kvs = head_step(head, x[:, s + 1 : s + 1 + t], feats, pos, seen, form, valid)
            for p, kv in zip(past, kvs, strict=True):
                p.append(kv)
            outs.append(hid)
            total = total + (hid * torch.linspace(-1, 1, hid.shape[-1])).sum()
            feats = out
        params = [feats0, *(p for p in head.parameters() if p.requires_grad)]
        grads = torch.autograd.grad(total, params, allow_unused=True)
        return torch.stack(outs), [gr for gr in grads if gr is not None]

    dense, g_dense = unroll("dense")
    other, g_other = unroll(impl)
    torch.testing.assert_close(other, dense, rtol=1e-5, atol=1e-5)
    assert len(g_dense) == len(g_other) > 3
    for a, c in zip(g_other, g_dense, strict=True):
        # fp32 sums of terms up to max|c| leave absolute errors in proportion to it
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5 + 1e-7 * c.abs().max().item())


def _reference_chain_attention(
    q: torch.Tensor, chain: list[tuple[torch.Tensor, torch.Tensor]], scale: float
) -> torch.Tensor:
    """Softmax over [causal context keys; each chain depth's own-row key], in float64."""
    rep = q.shape[1] // chain[0][0].shape[1]
    q = q.double()
    ks = [k.double().repeat_interleave(rep, 1) for k, _ in chain]
    vs = [v.double().repeat_interleave(rep, 1) for _, v in chain]
    t = q.shape[2]
    s0 = (q @ ks[0].transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in ks[1:]]
    p = torch.softmax(torch.cat([s0, *diag], -1), -1)
    out = p[..., :t] @ vs[0]
    for i, v in enumerate(vs[1:]):
        out = out + p[..., t + i : t + i + 1] * v
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("magnitude", [0.1, 1.0, 12.0])
def test_merged_chain_equals_softmax_over_all_keys(magnitude: float, device: str) -> None:
    """Large magnitudes put the softmax mass on a few keys (the context's or the chain's):
    the merge must not overflow, underflow to NaN or lose the small side. Values and the
    gradients of q, keys and values, against a float64 softmax over all keys (on a GPU the
    SDPA kernels there; bf16 too, with bf16's tolerance)."""
    from eagleserve.train.ttt import _merged_chain

    b, nkv, rep, t, d, n = 2, 2, 3, 9, 16, 3
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    q = torch.randn(b, nkv * rep, t, d, generator=g) * magnitude
    chain = [
        (torch.randn(b, nkv, t, d, generator=g) * magnitude, torch.randn(b, nkv, t, d, generator=g))
        for _ in range(1 + n)
    ]
    leaves = [q, *(x for kv in chain for x in kv)]
    w = torch.randn(b, nkv * rep, t, d, generator=g)
    scale = d**-0.5
    ref = [x.double().requires_grad_() for x in leaves]
    want = _reference_chain_attention(ref[0], list(zip(ref[1::2], ref[2::2])), scale)
    want_grads = torch.autograd.grad((want * w.double()).sum(), ref)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        # fp32 scores of size magnitude^2 carry absolute errors in proportion to it, and so
        # do their exponentials' weights
        fp32 = dict(rtol=1e-4, atol=1e-5 * (1 + magnitude**2))
        tol = fp32 if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
        xs = [x.to(device, dtype).requires_grad_() for x in leaves]
        got = _merged_chain(xs[0], list(zip(xs[1::2], xs[2::2])), scale, rep > 1)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double().cpu(), want.detach(), **tol)
        grads = torch.autograd.grad((got * w.to(device, dtype)).sum(), xs)
        for a, c in zip(grads, want_grads, strict=True):
            big = c.abs().max().item()
            torch.testing.assert_close(a.double().cpu(), c, rtol=tol["rtol"],
                                       atol=tol["atol"] * max(1.0, big))  # fmt: skip


@pytest.mark.parametrize("impl", ["sdpa", "merge"])
def test_every_depth_compiles_as_one_graph(tiny_model_dir: str, impl: str) -> None:
    """`--enable-torch-compile` traces each depth's head step whole, with dynamic shapes as
    the trainer compiles it (no graph break: each break is one more graph to compile and
    launch per depth and step) and computes what the eager step computes."""
    target, _ = load_target(tiny_model_dir, "float32", 64)
    assert target.config.num_attention_heads != target.config.num_key_value_heads  # GQA
    head = init_eagle_head("EAGLE3", target, seed=int(torch.randint(0, 1000, ())))
    compiled = torch.compile(head_step, dynamic=True, fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    b, t, depths = 2, 9, 3
    x = torch.randint(0, target.config.vocab_size, (b, t + depths), generator=g)
    feats = torch.randn(b, t, head.feature_size, generator=g)
    past: list[list] = [[]]
    with torch.autocast("cpu", torch.bfloat16):  # as the gpu recipe trains
        for s in range(depths):
            pos = (torch.arange(t) + s).expand(b, t)
            want = head_step(head, x[:, s + 1 : s + 1 + t], feats, pos, past, impl)
            got = compiled(head, x[:, s + 1 : s + 1 + t], feats, pos, [list(past[0])], impl)
            for a, c in zip(got[:2], want[:2], strict=True):
                torch.testing.assert_close(a, c, rtol=0, atol=0)
            past[0].append(want[2][0])
            feats = want[1]


class _Casts(TorchDispatchMode):
    """Every dtype cast made while active: (source storage, target dtype) counts, and the casts
    that turned a cast's output (or a view of it) back into its source's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, torch.dtype] = {}  # a cast's output storage -> its source's dtype
        self.keep: list[torch.Tensor] = []  # storages stay unique while the tensors live
        self.counts: dict[tuple[int, torch.dtype], int] = {}
        self.round_trips = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        src = args[0] if args else None
        if isinstance(src, (list, tuple)) and src:  # stack, cat
            src = src[0]
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
            return out
        at = src.untyped_storage().data_ptr()
        if func is torch.ops.aten._to_copy.default and out.dtype != src.dtype and src.dim() >= 3:
            self.counts[at, out.dtype] = self.counts.get((at, out.dtype), 0) + 1
            self.round_trips += self.made.get(at) == out.dtype
            self.made[out.untyped_storage().data_ptr()] = src.dtype
            self.keep += [src, out]
        elif at in self.made and func.overloadpacket.__name__ in self.MOVES:
            # a copy of a cast's output (a matmul's contiguous input) is still that output
            self.made[out.untyped_storage().data_ptr()] = self.made[at]
            self.keep.append(out)
        return out

    MOVES = {"clone", "_unsafe_view", "view", "reshape", "stack", "cat", "expand", "permute",
             "transpose", "unsqueeze", "contiguous", "copy_"}  # fmt: skip


@pytest.mark.parametrize("impl", ["dense", "sdpa", "merge"])
@pytest.mark.parametrize("layers", [1, 2])
def test_autocast_casts_each_activation_once(tiny_model_dir: str, impl: str, layers: int) -> None:
    """Under the gpu recipe's bf16 autocast, a depth's activations are each cast at most once
    to a dtype (the q/k/v and gate/up projections share one cast of their input) and none is
    cast back to the dtype it came from (an fp32 copy that an autocast matmul casts back): the
    copies are a large share of a training step's device time. (The backward mirrors the
    forward's casts.)"""
    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head("EAGLE3", target, num_hidden_layers=layers,
                           seed=int(torch.randint(0, 1000, ())))  # fmt: skip
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    b, t, depths = 2, 7, 3
    x = torch.randint(0, target.config.vocab_size, (b, t + depths), generator=g)
    feats = torch.randn(b, t, head.feature_size, generator=g)
    past: list[list] = [[] for _ in range(layers)]
    with torch.autocast("cpu", torch.bfloat16):
        for s in range(depths):
            pos = (torch.arange(t) + s).expand(b, t)
            with _Casts() as casts:
                hid, out, kvs = head_step(head, x[:, s + 1 : s + 1 + t], feats, pos, past, impl)
            assert casts.counts and max(casts.counts.values()) == 1, (s, casts.counts)
            assert casts.round_trips == 0, s
            for p, kv in zip(past, kvs, strict=True):
                p.append(tuple(z.detach() for z in kv))
            feats = out.detach()

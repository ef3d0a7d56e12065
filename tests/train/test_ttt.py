"""The unrolled head's depth >= 1 attention: the fused masked-SDPA form computes what the dense
form computes (outputs and gradients), for EAGLE and EAGLE3 heads, over several depths."""

from __future__ import annotations

import pytest
import torch

from eagleserve.spec.head_loader import init_eagle_head
from eagleserve.train.target import load_target
from eagleserve.train.ttt import chain_mask, head_step

pytestmark = pytest.mark.usefixtures("torch_threads")


def test_chain_mask_sees_context_and_own_chain() -> None:
    t, n = 5, 2
    m = chain_mask(t, n, torch.device("cpu"))
    assert m.shape == (t, (1 + n) * t)
    for j in range(t):
        seen = m[j].nonzero().flatten().tolist()
        assert seen == list(range(j + 1)) + [t + j, 2 * t + j]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_sdpa_chain_equals_dense(tiny_model_dir: str, algorithm: str) -> None:
    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head(algorithm, target, seed=int(torch.randint(0, 1000, ())))
    b, t, depths = 3, 11, 4
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    vocab = target.config.vocab_size
    x = torch.randint(0, vocab, (b, t + depths), generator=g)
    feats0 = torch.randn(b, t, head.feature_size, generator=g, requires_grad=True)

    def unroll(impl: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        past: list = []
        feats, total = feats0, torch.zeros(())
        outs = []
        for s in range(depths):
            pos = (torch.arange(t) + s).expand(b, t)
            hid, out, kv = head_step(head, x[:, s + 1 : s + 1 + t], feats, pos, past, impl)
            past.append(kv)
            outs.append(hid)
            total = total + (hid * torch.linspace(-1, 1, hid.shape[-1])).sum()
            feats = out
        params = [feats0, *(p for p in head.parameters() if p.requires_grad)]
        grads = torch.autograd.grad(total, params, allow_unused=True)
        return torch.stack(outs), [gr for gr in grads if gr is not None]

    dense, g_dense = unroll("dense")
    sdpa, g_sdpa = unroll("sdpa")
    torch.testing.assert_close(sdpa, dense, rtol=1e-5, atol=1e-5)
    assert len(g_dense) == len(g_sdpa) > 3
    for a, c in zip(g_sdpa, g_dense, strict=True):
        # fp32 sums of terms up to max|c| leave absolute errors in proportion to it
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5 + 1e-7 * c.abs().max().item())

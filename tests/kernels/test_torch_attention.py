"""The CPU attention path: shape invariance in fp64 compute mode.

With packed GGUF linears (bf16 inputs) one fp32 bit of difference between a decode step and
the verify of the same token can flip a greedy token; fp64 compute must make a query's output
bitwise independent of how many queries and which neighbours share its forward.
"""

from __future__ import annotations

import pytest
import torch
from attention_refs import padded_metadata

from eagleserve.kernels.torch_attention import padded_attention


def paged(num_slots: int, hkv: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    k = torch.randn(num_slots, hkv, d, generator=gen)
    v = torch.randn(num_slots, hkv, d, generator=gen)
    return k, v


@pytest.mark.parametrize("seed", range(4))
def test_fp64_decode_equals_verify_bitwise(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d = 6, 2, 32
    prefix, n = int(torch.randint(5, 300, (1,), generator=gen)), 4
    other = int(torch.randint(1, 400, (1,), generator=gen))  # a neighbour of another length
    k, v = paged(1024, hkv, d, gen)
    req_to_token = torch.zeros(3, 512, dtype=torch.long)
    req_to_token[1, : prefix + n] = torch.randperm(1000, generator=gen)[: prefix + n] + 1
    req_to_token[2, :other] = torch.randint(1, 1024, (other,), generator=gen)
    q = torch.randn(n, h, d, generator=gen)  # the n new tokens of request 1
    scale = d**-0.5
    # verify: all n queries of request 1 in one causal forward, next to request 2's decode
    prefix_lens = torch.tensor([prefix, other - 1])
    extend_lens = torch.tensor([n, 1])
    md = padded_metadata(req_to_token, torch.tensor([1, 2]), prefix_lens, extend_lens)
    q_other = torch.randn(1, h, d, generator=gen)
    verify = padded_attention(torch.cat([q, q_other]), k, v, md, scale, torch.float64)[:n]
    for i in range(n):  # decode: query i alone, seeing prefix + i + 1 keys
        md1 = padded_metadata(req_to_token, torch.tensor([1]), torch.tensor([prefix + i]),
                                    torch.tensor([1]))  # fmt: skip
        one = padded_attention(q[i : i + 1], k, v, md1, scale, torch.float64)
        assert torch.equal(one[0], verify[i]), i
        assert one.dtype == torch.float32
        ref = padded_attention(q[i : i + 1].double(), k.double(), v.double(), md1, scale)
        torch.testing.assert_close(one[0].double(), ref[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("seed", "n"), [(0, 1), (1, 3), (2, 4)])
def test_uniform_query_fast_path_equals_gather_path(seed: int, n: int) -> None:
    """Decode / verify batches (every request has n queries) skip the query gather and scatter;
    the result must be bit for bit what the general gather path computes."""
    import dataclasses

    gen = torch.Generator().manual_seed(seed)
    bs, h, hkv, d = 5, 6, 2, 16
    k, v = paged(2048, hkv, d, gen)
    lens = torch.randint(1, 200, (bs,), generator=gen)
    req_to_token = torch.zeros(bs, 256, dtype=torch.long)
    for b in range(bs):
        req_to_token[b, : lens[b] + n] = torch.randperm(2047, generator=gen)[: lens[b] + n] + 1
    q = torch.randn(bs * n, h, d, generator=gen)
    md = padded_metadata(
        req_to_token, torch.arange(bs), lens, torch.full((bs,), n, dtype=torch.long)
    )
    assert md.uniform_q
    fast = padded_attention(q, k, v, md, d**-0.5)
    general = padded_attention(q, k, v, dataclasses.replace(md, uniform_q=False), d**-0.5)
    assert torch.equal(fast, general)

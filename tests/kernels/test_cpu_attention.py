"""The AVX2 paged attention (kernels/cpu_attention.cpp) and RMSNorm (cpu_norm.cpp), per-token rows.

What serving relies on: the result of the fp64 reference within fp32 rounding, for causal
(chain) and tree-masked queries; and a query's result bitwise independent of its batch — a
verify row equals the decode of the same token, a tree node equals the decode along its path.
Over an fp16 pool (the packed target's default) the same holds, and the result is the fp32
kernel's over the same values widened: the pool's rounding is the only difference.
"""

from __future__ import annotations

import pytest
import torch
from attention_refs import padded_metadata

from eagleserve.kernels import cpu_ext
from eagleserve.kernels.torch_attention import padded_attention

pytestmark = pytest.mark.skipif(not cpu_ext.load(), reason="the AVX2 kernels do not run here")

H, HKV, D = 9, 3, 64  # SmolLM2's heads


def setup(
    gen: torch.Generator, lens: list[int], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    k = torch.randn(4096, HKV, D, generator=gen).to(dtype)
    v = torch.randn(4096, HKV, D, generator=gen).to(dtype)
    r2t = torch.zeros(len(lens) + 1, 1024, dtype=torch.long)
    for b, n in enumerate(lens):
        r2t[b + 1, :n] = torch.randperm(4095, generator=gen)[:n] + 1
    return k, v, r2t


def kernel(q, k, v, r2t, rpi, prefix, ext, tree=None, kv_lens=None) -> torch.Tensor:
    kv = prefix + ext if kv_lens is None else kv_lens
    return cpu_ext.paged_attention(q, k, v, r2t, rpi, prefix, ext, kv, tree, D**-0.5)


def reference(q, k, v, r2t, rpi, prefix, ext, tree=None) -> torch.Tensor:
    md = padded_metadata(r2t, rpi, prefix, ext, tree)
    return padded_attention(q.double(), k.double(), v.double(), md, D**-0.5)


@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [[4, 1, 3], [2, 3, 4], [37, 1, 21]])  # verify, and prefill rows
def test_chain_rows_match_reference_and_their_decodes(n: list[int], pool: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prefix = [int(torch.randint(1, 700, (), generator=gen)) for _ in n]
    k, v, r2t = setup(gen, [p + e for p, e in zip(prefix, n)], pool)
    rpi, pre, ext = torch.tensor([1, 2, 3]), torch.tensor(prefix), torch.tensor(n)
    q = torch.randn(sum(n), H, D, generator=gen)
    out = kernel(q, k, v, r2t, rpi, pre, ext)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v, r2t, rpi, pre, ext),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    if pool != torch.float32:  # the same values in an fp32 pool: the same bits
        assert torch.equal(kernel(q, k.float(), v.float(), r2t, rpi, pre, ext), out)
    threads = torch.get_num_threads()
    try:  # the queries shared out over other numbers of threads (cut inside a K/V head's)
        for other in {1, 2, 3} - {threads}:
            torch.set_num_threads(other)
            assert torch.equal(kernel(q, k, v, r2t, rpi, pre, ext), out), other
    finally:
        torch.set_num_threads(threads)
    row = 0
    for b in range(3):  # each row alone, as a decode at its own position
        for i in range(n[b]):
            one = kernel(q[row : row + 1].clone(), k, v, r2t, rpi[b : b + 1],
                         torch.tensor([prefix[b] + i]), torch.tensor([1]))  # fmt: skip
            assert torch.equal(one[0], out[row]), (b, i)
            row += 1


@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
def test_tree_node_equals_the_decode_along_its_path(pool: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prefix, n = int(torch.randint(1, 500, (), generator=gen)), 6
    # parents: 0 <- 1, 0 <- 2, 1 <- 3, 2 <- 4, 3 <- 5 (nodes in depth order)
    parents = [-1, 0, 0, 1, 2, 3]
    tree = torch.zeros(1, n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            tree[0, i, j] = True
            j = parents[j]
    k, v, r2t = setup(gen, [prefix + n], pool)
    rpi, pre, ext = torch.tensor([1]), torch.tensor([prefix]), torch.tensor([n])
    q = torch.randn(n, H, D, generator=gen)
    out = kernel(q, k, v, r2t, rpi, pre, ext, tree)
    torch.testing.assert_close(out.double(), reference(q, k, v, r2t, rpi, pre, ext, tree),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # Node 5's path is 0, 1, 3, 5: lay those slots out as a plain sequence and decode there.
    path = [0, 1, 3, 5]
    seq = torch.zeros(2, 1024, dtype=torch.long)
    seq[1, :prefix] = r2t[1, :prefix]
    seq[1, prefix : prefix + len(path)] = r2t[1, [prefix + p for p in path]]
    one = kernel(q[5:6].clone(), k, v, seq, torch.tensor([1]),
                 torch.tensor([prefix + len(path) - 1]), torch.tensor([1]))  # fmt: skip
    assert torch.equal(one[0], out[5])


def has_avx512() -> bool:
    try:
        cpu_ext.attention_isa("avx512")
    except RuntimeError:
        return False
    finally:
        cpu_ext.attention_isa("auto")
    return True


@pytest.mark.skipif(not cpu_ext.load() or not has_avx512(), reason="no AVX-512 here")
@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
def test_avx512_rows_are_avx2_bits(pool: torch.dtype) -> None:
    """A process runs a prefill's rows on the AVX-512 kernels and a decode's on AVX2's: the two
    must give the same bits, or a verify row would not equal its decode. Random batches of
    prefill chunks (units of 5-8 rows on one slot list run wide), verifies and decodes, causal
    and tree-masked, with heads whose GQA groups share each K/V row."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(6):
        n = [int(torch.randint(1, 40, (), generator=gen)) for _ in range(3)]
        prefix = [int(torch.randint(0, 900, (), generator=gen)) for _ in n]
        k, v, r2t = setup(gen, [p + e for p, e in zip(prefix, n)], pool)
        rpi, pre, ext = torch.tensor([1, 2, 3]), torch.tensor(prefix), torch.tensor(n)
        q = torch.randn(sum(n), H, D, generator=gen)
        tree = torch.rand(3, max(n), max(n), generator=gen) < 0.5  # any mask: rows alike
        outs = {}
        for isa in ("avx2", "avx512"):
            cpu_ext.attention_isa(isa)
            try:
                outs[isa] = (
                    kernel(q, k, v, r2t, rpi, pre, ext),
                    kernel(q, k, v, r2t, rpi, pre, ext, tree | torch.eye(max(n)).bool()),
                )
            finally:
                cpu_ext.attention_isa("auto")
        assert torch.equal(outs["avx2"][0], outs["avx512"][0]), (n, prefix)
        assert torch.equal(outs["avx2"][1], outs["avx512"][1]), (n, prefix)


def test_rms_norm_matches_the_composite_and_keeps_rows_apart() -> None:
    x = torch.randn(7, 576) * torch.rand(7, 1) * 10
    w = torch.randn(576)
    y = cpu_ext.rms_norm(x, w, 1e-5)
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    for i in range(7):
        assert torch.equal(cpu_ext.rms_norm(x[i : i + 1].clone(), w, 1e-5)[0], y[i])


@pytest.mark.parametrize("pool", [torch.float32, torch.float16])
def test_store_kv_writes_the_slots_as_index_assignment_does(pool: torch.dtype) -> None:
    """The new tokens' K/V, views of a fused q/k/v projection, land in their slots and nowhere
    else; into an fp16 pool rounded as torch rounds (`.half()`, here with values past fp16's
    range and below its normal range)."""
    t, nh, nkv, d = 5, 9, 3, 64
    qkv = torch.randn(t, nh + 2 * nkv, d) * torch.logspace(-6, 5, t).view(t, 1, 1)
    k, v = qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
    kb, vb = torch.randn(40, nkv, d).to(pool), torch.randn(40, nkv, d).to(pool)
    loc = torch.randperm(40)[:t]
    ref_k, ref_v = kb.clone(), vb.clone()
    ref_k[loc], ref_v[loc] = k.to(pool), v.to(pool)
    cpu_ext.store_kv_(kb, vb, loc, k, v)
    assert torch.equal(kb, ref_k) and torch.equal(vb, ref_v)

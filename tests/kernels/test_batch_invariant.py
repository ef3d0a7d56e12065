"""kernels/batch_invariant.py: each output row is bitwise the same whatever the batch around it
(alone, in 1..64 rows, inside a verify / tree / extend layout), and close to the plain math.
Under the Triton interpreter on CPU (no GPU here); on a GPU the same tests run for real."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import attention_refs as ref  # noqa: E402

from eagleserve.kernels import batch_invariant as bi  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Paged:
    """Requests in shuffled req_to_token rows, their positions on a random permutation of KV
    slots; unused entries point at real slots of random data (reading past a length is wrong)."""

    def __init__(
        self, seq_lens: list[int], kv_heads: int, head_dim: int, gen: torch.Generator,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        bs, slots_n = len(seq_lens), sum(seq_lens) + 7
        self.max_len = max(seq_lens) + 5
        self.k = torch.randn(slots_n, kv_heads, head_dim, generator=gen).to(dtype)
        self.v = torch.randn(slots_n, kv_heads, head_dim, generator=gen).to(dtype)
        self.req_to_token = torch.randint(0, slots_n, (bs + 2, self.max_len), generator=gen)
        self.req_pool_indices = torch.randperm(bs + 2, generator=gen)[:bs]
        slots, off = torch.randperm(slots_n, generator=gen), 0
        for b, n in enumerate(seq_lens):
            self.req_to_token[self.req_pool_indices[b], :n] = slots[off : off + n]
            off += n


def random_tree_masks(bs: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, n, n] bool: query i sees j where j is i or an ancestor (random parents, p[i] < i)."""
    masks = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                masks[b, i, j] = True
                j = parents[j]
    return masks


def rand(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k, n = 96, 80  # neither a multiple of the tile
    x = rand(64, k, gen=gen, dtype=dtype)
    w = rand(n, k, gen=gen, dtype=dtype) * 0.1
    b = rand(n, gen=gen, dtype=dtype)
    full = bi.matmul(x, w, b)
    assert full.dtype == dtype
    torch.testing.assert_close(
        full.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
        atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2,
    )  # fmt: skip
    for m in (1, 3, 17, 64):
        assert torch.equal(bi.matmul(x[:m], w, b), full[:m]), m
    for i in (0, 5, 63):  # a row alone, taken from any place of the batch
        assert torch.equal(bi.matmul(x[i : i + 1], w, b), full[i : i + 1]), i
    # Leading dims are kept, and no bias works.
    assert torch.equal(bi.matmul(x.view(8, 8, k), w).view(64, n), bi.matmul(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = rand(40, 72, gen=gen, dtype=dtype) * 3
    w = (1 + 0.1 * torch.randn(72, generator=gen)).to(dtype).to(DEV)
    full = bi.rms_norm(x, w, 1e-5)
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(full.float(), want.float(), atol=1e-2, rtol=1e-2)
    for m in (1, 2, 33):
        assert torch.equal(bi.rms_norm(x[:m], w, 1e-5), full[:m])
    assert torch.equal(bi.rms_norm(x[7:8], w, 1e-5), full[7:8])


def decode_alone(q: torch.Tensor, p: Paged, table: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """One query row computed as a batch of one decode over table[row, :n]."""
    one = torch.tensor([row], device=DEV)
    return bi.row_attention(
        q, p.k.to(DEV), p.v.to(DEV), table, one, torch.tensor([n], device=DEV), 0.125, n
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_and_verify_rows_equal_their_decodes(dtype: torch.dtype) -> None:
    """A causal extend (prefix-cached, chain verify) computes every row as the decode at that
    position would, across split boundaries (256 positions) too."""
    gen = torch.Generator().manual_seed(3)
    kv_lens = [5, 300, 4, 530]
    extend_lens = [5, 4, 1, 3]  # a prefill, a chain verify over a prefix, a decode, an extend
    h, hkv, d = 4, 2, 32
    p = Paged(kv_lens, hkv, d, gen, dtype)
    r2t = p.req_to_token.to(DEV)
    t = sum(extend_lens)
    q = rand(t, h, d, gen=gen, dtype=dtype)
    kv = torch.tensor(kv_lens, device=DEV)
    ext = torch.tensor(extend_lens, device=DEV)
    req, lens = bi.causal_rows(kv, ext, t)
    row_idx = p.req_pool_indices.to(DEV)[req]
    out = bi.row_attention(q, p.k.to(DEV), p.v.to(DEV), r2t, row_idx, lens, 0.125, max(kv_lens))
    want = ref.extend_attention_ref(
        q.float(), p.k.float().to(DEV), p.v.float().to(DEV), r2t, p.req_pool_indices.to(DEV),
        kv - ext, ext, 0.125,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), want, atol=2e-2 if dtype != torch.float32 else 1e-4,
                               rtol=1e-2)  # fmt: skip
    for i in range(t):
        alone = decode_alone(q[i : i + 1], p, r2t, int(row_idx[i]), int(lens[i]))
        assert torch.equal(alone, out[i : i + 1]), i
    # The same rows in a batch of their own (another grid depth) are the same bits.
    some = torch.tensor([3, 9, 12], device=DEV)
    sub = bi.row_attention(
        q[some], p.k.to(DEV), p.v.to(DEV), r2t, row_idx[some], lens[some], 0.125, 2048
    )
    assert torch.equal(sub, out[some])


def test_tree_rows_equal_the_decode_of_their_path() -> None:
    """A tree verify row equals the decode that follows committing its ancestors: the prefix,
    then its ancestors in depth order, then itself, at consecutive positions."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16
    prefix, n, bs = [7, 260], 6, 2
    h, hkv, d = 3, 1, 32
    p = Paged([a + n for a in prefix], hkv, d, gen, dtype)
    r2t = p.req_to_token.to(DEV)
    rpi = p.req_pool_indices.to(DEV)
    mask = random_tree_masks(bs, n, gen).to(DEV)
    q = rand(bs * n, h, d, gen=gen, dtype=dtype)
    pl = torch.tensor(prefix, device=DEV)
    table, lens = bi.tree_row_table(r2t, rpi, pl, mask, p.max_len)
    rows = torch.arange(bs * n, device=DEV)
    out = bi.row_attention(q, p.k.to(DEV), p.v.to(DEV), table, rows, lens, 0.125, p.max_len)
    want = ref.tree_verify_attention_ref(
        q.float(), p.k.float().to(DEV), p.v.float().to(DEV), r2t, rpi, pl, mask, 0.125
    )
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1e-2)
    for b in range(bs):
        for i in range(n):
            path = [prefix[b] + j for j in range(n) if mask[b, i, j]]
            slots = r2t[rpi[b], list(range(prefix[b])) + path]
            alone = decode_alone(q[b * n + i : b * n + i + 1], p, slots[None, :], 0, len(slots))
            assert torch.equal(alone, out[b * n + i : b * n + i + 1]), (b, i)

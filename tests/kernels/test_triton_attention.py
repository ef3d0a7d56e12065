"""Triton paged-attention kernels vs the torch references, under the Triton CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from triton_mode import DEVICE  # before triton is imported: picks the interpreter without a GPU

pytest.importorskip("triton")

import attention_refs as ref  # noqa: E402
from triton_calls import extend_attention, tree_verify_attention, tri  # noqa: E402

from eagleserve.layers.attention import TorchAttnBackend  # noqa: E402
from eagleserve.layers.forward_batch import ForwardBatch, HostLens  # noqa: E402
from eagleserve.layers.triton_backend import TritonAttnBackend  # noqa: E402
from eagleserve.mem_cache.kv_cache import TokenToKVPool  # noqa: E402

ATOL = 1e-4
RTOL = 1e-4


class Paged:
    """Random paged layout: requests live in shuffled req_to_token rows and map their positions
    to a random permutation of KV slots. Unused req_to_token entries point at real slots holding
    random data, so reading past a request's length gives a wrong answer, not a silent zero."""

    def __init__(
        self,
        seq_lens: list[int],
        kv_heads: int,
        head_dim: int,
        gen: torch.Generator,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        bs = len(seq_lens)
        self.max_len = max(seq_lens) + 5
        num_rows = bs + 2
        num_slots = sum(seq_lens) + 7
        self.k = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
        self.v = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
        self.req_to_token = torch.randint(
            0, num_slots, (num_rows, self.max_len), generator=gen, dtype=torch.int64
        )  # [R, L]
        self.req_pool_indices = torch.randperm(num_rows, generator=gen)[:bs]  # [bs]
        slots = torch.randperm(num_slots, generator=gen)
        off = 0
        for b, n in enumerate(seq_lens):
            self.req_to_token[self.req_pool_indices[b], :n] = slots[off : off + n]
            off += n


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: mask[i, j] = j is i or an ancestor of i (parents[i] < i, root -1)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_tree_masks(bs: int, n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[bs, n, n] bool; kind "chain" (causal) or "random" (random parent arrays per request)."""
    masks = []
    for _ in range(bs):
        if kind == "chain":
            parents = [i - 1 for i in range(n)]
        else:
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        masks.append(ancestor_mask(parents))
    return torch.stack(masks)


def heads(group: int) -> tuple[int, int]:
    """(H, Hkv) for a GQA ratio, kept small: the interpreter runs one program at a time."""
    return {1: (2, 2), 3: (3, 1), 4: (8, 2)}[group]


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seq_lens,group,head_dim,splits",
    [
        ([1], 1, 64, 1),
        ([1, 37, 70, 5], 1, 64, 3),
        ([65, 2, 33], 3, 128, 1),
        ([130, 1, 17, 64, 9], 4, 64, 4),
        ([3, 100], 4, 128, 7),  # more splits than positions for the short request
        ([40, 9], 3, 80, 2),  # head_dim not a power of two
        ([700, 5, 64], 3, 64, 32),  # the most splits: stage 2 merges all it can hold
    ],
)
def test_decode_matches_reference(
    seq_lens: list[int], group: int, head_dim: int, splits: int
) -> None:
    gen = torch.Generator().manual_seed(1000 + sum(seq_lens) + group + head_dim + splits)
    num_heads, kv_heads = heads(group)
    pg = Paged(seq_lens, kv_heads, head_dim, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    seq = torch.tensor(seq_lens)
    scale = head_dim**-0.5
    args = (q, pg.k, pg.v, pg.req_to_token, pg.req_pool_indices, seq, scale)
    out = tri.decode_attention(*args, splits)
    torch.testing.assert_close(out, ref.decode_attention_ref(*args), atol=ATOL, rtol=RTOL)


def test_split_counts_are_few_powers_of_two() -> None:
    """A context growing token by token meets at most log2(max) + 1 split counts, every split
    over 128 positions long."""
    seen = set()
    for bs in (1, 3, 16):
        for n in range(1, 20_000, 7):
            k = tri.choose_num_kv_splits(bs, 2, n)
            assert k & (k - 1) == 0 and (k == 1 or n / k > 128)
            seen.add(k)
    assert len(seen) <= 6


@pytest.mark.skipif(DEVICE.type == "cpu", reason="compiled kernels: a GPU (none interpreted)")
def test_every_split_count_runs_one_compiled_kernel() -> None:
    """The split count is a run-time value: a context or batch reaching a new count compiles
    nothing (on a GPU that would be a compile inside a decode step)."""
    gen = torch.Generator().manual_seed(11)
    pg = Paged([900, 40, 3], 1, 64, gen)
    q = torch.randn(3, 4, 64, generator=gen)
    args = (q, pg.k, pg.v, pg.req_to_token, pg.req_pool_indices, torch.tensor([900, 40, 3]), 0.1)
    want = ref.decode_attention_ref(*args)
    from eagleserve.kernels import triton_decode

    kernels = (triton_decode._decode_stage1_kernel, triton_decode._decode_stage2_kernel)
    compiled: list[int] = []
    for splits in (1, 2, 4, 8, 16, 32):
        torch.testing.assert_close(tri.decode_attention(*args, splits), want, atol=ATOL, rtol=RTOL)
        caches = [getattr(k, "device_caches", None) for k in kernels]
        if None in caches:
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        # Every variant this process compiled (other tests' shapes too): the first split count
        # may add this shape's, no later one may add any.
        compiled.append(sum(len(c[torch.cuda.current_device()][0]) for c in caches))
    assert compiled == compiled[:1] * len(compiled), compiled


# ---------------------------------------------------------------------------------------------
# extend
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefix_lens,extend_lens,group,head_dim",
    [
        ([0], [1], 1, 64),
        ([0, 10, 3], [5, 1, 17], 1, 128),
        ([40, 0], [70, 9], 3, 64),  # 70 new tokens x group 3: 4 row blocks
        ([7, 64, 0, 1], [3, 2, 33, 1], 4, 128),
        ([5, 12], [6, 20], 3, 80),
    ],
)
def test_extend_matches_reference(
    prefix_lens: list[int], extend_lens: list[int], group: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(2000 + sum(prefix_lens) + sum(extend_lens) + head_dim)
    num_heads, kv_heads = heads(group)
    pg = Paged(
        [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)], kv_heads, head_dim, gen
    )
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen)
    pl, el = torch.tensor(prefix_lens), torch.tensor(extend_lens)
    args = (q, pg.k, pg.v, pg.req_to_token, pg.req_pool_indices, pl, el, head_dim**-0.5)
    out = extend_attention(*args, max(extend_lens))
    torch.testing.assert_close(out, ref.extend_attention_ref(*args), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# tree verify
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefix_lens,n,kind,group,head_dim",
    [
        ([0], 1, "chain", 1, 64),
        ([5, 0, 33], 4, "chain", 1, 64),
        ([12, 1], 7, "random", 3, 64),
        ([70, 9, 20], 8, "random", 4, 128),
        ([3, 50], 20, "random", 4, 64),  # 20 x group 4 = 80 rows: 2 row blocks
        ([8], 6, "random", 3, 80),
    ],
)
def test_tree_verify_matches_reference(
    prefix_lens: list[int], n: int, kind: str, group: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(3000 + sum(prefix_lens) + n + head_dim)
    bs = len(prefix_lens)
    num_heads, kv_heads = heads(group)
    pg = Paged([p + n for p in prefix_lens], kv_heads, head_dim, gen)
    q = torch.randn(bs * n, num_heads, head_dim, generator=gen)
    mask = random_tree_masks(bs, n, kind, gen)
    pl = torch.tensor(prefix_lens)
    args = (q, pg.k, pg.v, pg.req_to_token, pg.req_pool_indices, pl, mask, head_dim**-0.5)
    out = tree_verify_attention(*args)
    torch.testing.assert_close(out, ref.tree_verify_attention_ref(*args), atol=ATOL, rtol=RTOL)


def test_chain_tree_equals_causal_extend() -> None:
    gen = torch.Generator().manual_seed(11)
    pg = Paged([9, 25], 2, 64, gen)
    n = 5
    q = torch.randn(2 * n, 8, 64, generator=gen)
    pl, el = torch.tensor([4, 20]), torch.tensor([n, n])
    common = (q, pg.k, pg.v, pg.req_to_token, pg.req_pool_indices, pl)
    tree = tree_verify_attention(*common, random_tree_masks(2, n, "chain", gen), 0.2)
    causal = extend_attention(*common, el, 0.2, n)
    torch.testing.assert_close(tree, causal, atol=ATOL, rtol=RTOL)


def test_non_contiguous_tree_mask() -> None:
    gen = torch.Generator().manual_seed(12)
    pg = Paged([10, 14], 1, 64, gen)
    n = 4
    q = torch.randn(2 * n, 3, 64, generator=gen)
    mask = random_tree_masks(2, n, "random", gen).transpose(1, 2).contiguous().transpose(1, 2)
    assert not mask.is_contiguous()
    args = (q, pg.k, pg.v, pg.req_to_token, pg.req_pool_indices, torch.tensor([6, 10]), mask, 0.1)
    out = tree_verify_attention(*args)
    torch.testing.assert_close(out, ref.tree_verify_attention_ref(*args), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# 16-bit inputs (fp32 accumulation; compared with the fp32 reference on the rounded inputs)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    pg = Paged([33, 8, 20], 2, 64, gen, dtype=dtype)
    k32, v32 = pg.k.float(), pg.v.float()
    pl, el = torch.tensor([30, 0, 12]), torch.tensor([3, 8, 8])
    tol = {"atol": 2e-2, "rtol": 2e-2}
    common = (pg.req_to_token, pg.req_pool_indices)

    q = torch.randn(int(el.sum()), 8, 64, generator=gen).to(dtype)
    out = extend_attention(q, pg.k, pg.v, *common, pl, el, 0.125, 8)
    assert out.dtype == dtype
    want = ref.extend_attention_ref(q.float(), k32, v32, *common, pl, el, 0.125)
    torch.testing.assert_close(out.float(), want, **tol)

    qd = torch.randn(3, 8, 64, generator=gen).to(dtype)
    seq = pl + el
    out = tri.decode_attention(qd, pg.k, pg.v, *common, seq, 0.125, 2)
    want = ref.decode_attention_ref(qd.float(), k32, v32, *common, seq, 0.125)
    torch.testing.assert_close(out.float(), want, **tol)


# ---------------------------------------------------------------------------------------------
# backend end to end, against TorchAttnBackend
# ---------------------------------------------------------------------------------------------
class BackendHarness:
    """A real KV pool and req_to_token; runs one forward through both backends on layer 1."""

    def __init__(self, num_heads: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> None:
        self.h, self.hkv, self.d, self.gen = num_heads, kv_heads, head_dim, gen
        self.pool = TokenToKVPool(400, 2, kv_heads, head_dim, torch.float32, DEVICE)
        self.req_to_token = torch.zeros(6, 128, dtype=torch.int64, device=DEVICE)
        # Fill the pool with random K/V (a prior forward's cache) so prefixes are not zeros.
        for buf in self.pool.k_buffer + self.pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        self.scale = head_dim**-0.5
        self.torch_be = TorchAttnBackend(self.req_to_token, self.scale)
        self.triton_be = TritonAttnBackend(self.req_to_token, self.scale)

    def assign(self, req_pool_indices: list[int], kv_lens: list[int]) -> None:
        """Gives each request fresh shuffled slots for positions [0, kv_len)."""
        for r, n in zip(req_pool_indices, kv_lens, strict=True):
            slots = self.pool.alloc(n)
            assert slots is not None
            self.req_to_token[r, :n] = slots[torch.randperm(n, generator=self.gen)]

    def run(
        self,
        mode: str,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        tree_mask: torch.Tensor | None = None,
        kv_lens: list[int] | None = None,
        query_offset: list[int] | None = None,
    ) -> None:
        """query_offset[b]: position, relative to prefix, of request b's first written token."""
        rpi = torch.tensor(req_pool_indices, device=DEVICE)
        offs = query_offset or [0] * len(req_pool_indices)
        loc = torch.cat(
            [
                self.req_to_token[r, p + o : p + o + e]
                for r, p, e, o in zip(req_pool_indices, prefix_lens, extend_lens, offs, strict=True)
            ]
        )
        t = loc.numel()
        q = torch.randn(t, self.h, self.d, generator=self.gen).to(DEVICE)
        k = torch.randn(t, self.hkv, self.d, generator=self.gen).to(DEVICE)
        v = torch.randn(t, self.hkv, self.d, generator=self.gen).to(DEVICE)
        outs = []
        for be in (self.torch_be, self.triton_be):
            fb = ForwardBatch(
                mode=mode,  # type: ignore[arg-type]
                input_ids=torch.zeros(t, dtype=torch.int64, device=DEVICE),
                positions=torch.zeros(t, dtype=torch.int64, device=DEVICE),
                out_cache_loc=loc,
                req_pool_indices=rpi,
                prefix_lens=torch.tensor(prefix_lens, device=DEVICE),
                extend_lens=torch.tensor(extend_lens, device=DEVICE),
                host=HostLens.of(
                    extend_lens,
                    kv_lens or [p + e for p, e in zip(prefix_lens, extend_lens)],
                ),
                kv_pool=self.pool,
                attn_backend=be,
                tree_mask=None if tree_mask is None else tree_mask.to(DEVICE),
                kv_lens=None if kv_lens is None else torch.tensor(kv_lens, device=DEVICE),
            )
            be.init_forward_metadata(fb)
            outs.append(be.forward(q, k, v, 1, fb))
        torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("group", [1, 4])
def test_backend_extend_decode_verify(group: int) -> None:
    gen = torch.Generator().manual_seed(40 + group)
    num_heads, kv_heads = heads(group)
    hx = BackendHarness(num_heads, kv_heads, 64, gen)
    rpi = [3, 0, 5]
    hx.assign(rpi, [60, 60, 60])
    # Prefill with one request already partly cached.
    hx.run("extend", rpi, [0, 12, 0], [21, 9, 1])
    # Decode: one token per request.
    hx.run("decode", rpi, [21, 21, 1], [1, 1, 1])
    # Chain drafting step (mode draft, one token each) takes the decode kernel too.
    hx.run("draft", rpi, [22, 22, 2], [1, 1, 1])
    # Verify of a chain (no tree_mask): causal extend.
    hx.run("verify", rpi, [22, 22, 2], [4, 4, 4])
    # Verify of a random tree.
    n = 6
    hx.run("verify", rpi, [22, 22, 2], [n] * 3, tree_mask=random_tree_masks(3, n, "random", gen))


def test_backend_tree_drafting_step() -> None:
    """Draft step of a top-k tree: topk queries per request over a region of step * topk
    positions after the prefix (n_q < n_new), with kv_lens set, as EagleWorker builds it."""
    gen = torch.Generator().manual_seed(50)
    hx = BackendHarness(8, 2, 64, gen)
    rpi = [1, 4]
    prefix, topk, step = [17, 40], 3, 2
    hx.assign(rpi, [p + step * topk for p in prefix])
    region = torch.zeros(2, topk, step * topk, dtype=torch.bool)
    for b in range(2):
        for i in range(topk):
            region[b, i, int(torch.randint(0, topk, (1,), generator=gen))] = True  # parent
            region[b, i, topk + i] = True  # self
    hx.run(
        "draft",
        rpi,
        prefix,
        [topk, topk],
        tree_mask=region,
        kv_lens=[p + step * topk for p in prefix],
        query_offset=[(step - 1) * topk] * 2,
    )

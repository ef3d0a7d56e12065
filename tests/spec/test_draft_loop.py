"""The chain or tree draft as one function of device tensors (what a device graph captures whole:
spec/draft_loop.py) drafts exactly the tokens of the step-by-step draft, on every iteration of
real generations (the same head KV written in the same slots), and leaves the generations
lossless."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lossless_fixtures import heads, params, prompts, reference, run_staggered, target_dir

from eagleserve import Engine
from eagleserve.layers.forward_batch import ForwardBatch, HostLens

__all__ = ["heads", "reference", "target_dir"]  # module-scoped fixtures of lossless_fixtures


@pytest.mark.parametrize(
    ("algo", "steps", "topk", "ndt"),
    [("EAGLE", 3, 1, 4), ("EAGLE-random", 5, 1, 6), ("EAGLE3", 2, 1, 3), ("EAGLE", 3, 2, 6),
     ("EAGLE3", 2, 4, 8)],
)  # fmt: skip
def test_draft_loop_drafts_the_step_by_step_tokens(
    target_dir: str,
    heads: dict[str, str],
    reference: list[list[int]],
    algo: str,
    steps: int,
    topk: int,
    ndt: int,
) -> None:
    eng = Engine(
        model=target_dir,
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        disable_overlap_schedule=True,
        speculative_algorithm=algo.split("-")[0],
        speculative_draft_model_path=heads[algo],
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    drafter = eng.scheduler.worker.drafter
    real = drafter.draft
    checked = []

    def draft(batch: Any, info: Any, k: int, grammar: Any = None, sampling: Any = None) -> Any:
        L = batch.seq_lens
        fb = ForwardBatch(
            mode="draft",
            input_ids=batch.input_ids,  # a tree's root: the bonus tokens
            positions=L,
            out_cache_loc=L,
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=L.clone(),
            extend_lens=torch.ones_like(L),
            host=HostLens(1, int(batch.seq_lens_cpu.max()), True),
            kv_pool=drafter.kv_pool,
            attn_backend=drafter.attn_backend,
        )
        extras = {"topk_p": info.topk_p, "topk_index": info.topk_index,
                  "hidden": info.hidden_states}  # fmt: skip
        loop = (drafter.loops.chain if topk == 1 else drafter.loops.tree)(fb, extras, k)
        pool = drafter.kv_pool
        kv = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
        tree = real(batch, info, k, grammar, sampling)  # rewrites the same head KV, slot for slot
        assert all(torch.equal(a, b) for a, b in zip(kv, (*pool.k_buffer, *pool.v_buffer)))
        if topk == 1:  # the chain's drafted tokens, after its root
            assert torch.equal(loop[2], tree.draft_tokens[:, 1:])
        else:  # the verify tree the tree loop built
            want = (tree.draft_tokens, tree.parents, tree.depths, tree.tree_mask)
            assert all(torch.equal(got, w) for got, w in zip(loop, want, strict=True))
        checked.append(batch.batch_size)
        return tree

    drafter.draft = draft
    assert run_staggered(eng, prompts(0), params()) == reference
    assert len(checked) > 10 and max(checked) > 1


@pytest.mark.parametrize("topk", [1, 4])
def test_draft_rows_are_each_steps_rows(topk: int) -> None:
    """Every step's positions, KV slots and KV lengths, made at once before the steps
    (`draft_rows`), are the ones a step makes on its own: position L + depth - 1 for each
    branch, slot of region node (depth - 1) * topk + b (a chain's: its position), lengths
    L + depth * topk."""
    from eagleserve.spec.draft_loop import RowOffsets, draft_rows

    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    req_to_token = torch.randperm(6 * 96, generator=gen).view(6, 96)
    bs, steps = 3, 4
    L = torch.randint(0, 60, (bs,), generator=gen)
    rpi = torch.randperm(6, generator=gen)[:bs]
    fb = ForwardBatch(mode="draft", input_ids=torch.zeros(bs, dtype=torch.long), positions=L,
                      out_cache_loc=L, req_pool_indices=rpi, prefix_lens=L,
                      extend_lens=torch.ones_like(L), host=HostLens(1, 96, True), kv_pool=None,
                      attn_backend=None)  # fmt: skip
    rows = draft_rows(fb, req_to_token, RowOffsets.build(steps, topk, L.device), steps)
    assert rows.extend_lens.tolist() == [topk] * bs
    for depth in range(1, steps + 1):
        nodes = L[:, None] + (depth - 1) * topk + torch.arange(topk)  # [bs, topk]
        want_loc = req_to_token[rpi[:, None], nodes].reshape(-1)
        assert torch.equal(rows.positions[depth - 1], (L + depth - 1).repeat_interleave(topk))
        assert torch.equal(rows.out_cache_loc[depth - 1], want_loc)
        assert torch.equal(rows.kv_lens[depth - 1], L + depth * topk)
    none = draft_rows(fb, req_to_token, RowOffsets.build(steps, topk, L.device), 0)
    assert none.positions.shape == (0, bs * topk)

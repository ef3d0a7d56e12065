"""Sampled requests' drafts (spec/draft_extend.py `DraftDraw`): drawn from the head's distribution
on the noise the target draws the same position with, so a head that weighs tokens as the
target does drafts the token the target then draws."""

from __future__ import annotations

import random

import pytest
import torch
from eagle_head_formats import V, target_dir_fixture, target_fixture
from sampling_fixtures import PROMPT, head_dir, small_target

from eagleserve import Engine, SamplingParams
from eagleserve.kernels import cpu_ext
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.sampling.sampler import sample
from eagleserve.sampling.sampling_info import DrawKernel, SamplingInfo
from eagleserve.spec import accept, draft_extend
from eagleserve.spec.draft_extend import DraftDraw, drawn_candidate, seed_from_logits
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import init_eagle_head

# Fixtures of eagle_head_formats and sampling_fixtures.
__all__ = ["head_dir", "small_target", "target_dir_fixture", "target_fixture"]


def _head(target: LlamaForCausalLM, draft_ids: torch.Tensor) -> EagleHead:
    head = init_eagle_head("EAGLE3", target, len(draft_ids), draft_token_ids=draft_ids)
    head.freeze_vocab_map()
    return head


def _info(
    temperatures: torch.Tensor, greedy: list[bool], kernel: DrawKernel | None = None
) -> SamplingInfo:
    m = len(greedy)
    return SamplingInfo(
        temperatures=temperatures.view(m, 1),
        top_ps=torch.ones(m),
        top_ks=torch.full((m,), V),
        min_ps=torch.zeros(m),
        is_greedy=greedy,
        seeds=torch.randint(0, 2**63 - 1, (m,)),
        needs_top_k=False,
        needs_top_p=False,
        needs_min_p=False,
        draw_kernel=kernel,
    )


KERNELS = [None, "cpu"] if cpu_ext.load() else [None]  # torch ops; kernels/cpu_sample.cpp


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("draft_vocab", [V, V // 3])
def test_a_head_with_the_targets_distribution_drafts_the_targets_draw(
    target: LlamaForCausalLM, draft_vocab: int, kernel: DrawKernel | None
) -> None:
    """Head logits equal to the target's on its draft vocabulary (shifted by a constant: only
    the distribution counts): the draft is the target's own draw wherever that token is in the
    draft vocabulary, at every temperature; outside it, never (the head cannot name it). Both
    draw paths: a CPU engine's target and head draw with the kernel."""
    draft_ids = torch.randperm(V)[:draft_vocab].sort().values
    head = _head(target, draft_ids)
    m = 400
    target_logits = torch.randn(m, V) * torch.rand(m, 1) * 6
    info = _info(torch.rand(m) * 1.5 + 0.2, [False] * m, kernel)
    positions = torch.randint(0, 2**31, (m,))
    wanted = sample(target_logits, info, positions)
    head_logits = target_logits[:, draft_ids] + torch.randn(m, 1)
    p, drafted = drawn_candidate(head, head_logits, DraftDraw(info, positions))
    reachable = torch.isin(wanted, draft_ids)
    assert torch.equal(drafted[:, 0] == wanted, reachable)
    assert reachable.float().mean() > (0.99 if draft_vocab == V else 0.2)
    # Its probability under the head (at temperature 1, as top_candidates gives it).
    want_p = torch.softmax(head_logits, -1).gather(1, torch.searchsorted(draft_ids, drafted))
    assert torch.allclose(p, want_p, rtol=1e-5)


def test_greedy_rows_draft_their_argmax_and_the_draw_follows_the_position(
    target: LlamaForCausalLM,
) -> None:
    """In a batch with greedy rows, those rows' seeds are the head's argmax; a sampled row's
    draft depends on the position it will sit at (its noise), not only on the logits."""
    draft_ids = torch.randperm(V)[: V // 2].sort().values
    head = _head(target, draft_ids)
    m = 64
    logits = torch.randn(m, len(draft_ids)) * 0.3  # flat: many tokens can win
    greedy = [random.random() < 0.5 for _ in range(m)]
    info = _info(torch.ones(m), greedy)
    positions = torch.randint(0, 2**31, (m,))
    feats = torch.randn(m, 8)
    seed = seed_from_logits(head, logits, feats, 1, DraftDraw(info, positions))
    rows = torch.tensor(greedy)
    assert torch.equal(seed.topk_index[rows, 0], draft_ids[logits[rows].argmax(-1)])
    assert seed.hidden_states is feats
    moved = seed_from_logits(head, logits, feats, 1, DraftDraw(info, positions + 1))
    assert not torch.equal(moved.topk_index[~rows], seed.topk_index[~rows])
    assert torch.equal(moved.topk_index[rows], seed.topk_index[rows])


def test_a_chains_drafts_are_drawn_where_its_verify_draws(
    small_target: tuple[str, object], head_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served: at every verify of a sampled request, the chain's k drafts were drawn on the
    noise of exactly the positions the verify draws its first k nodes' choices at (an offset
    there would leave them lossless but no better than independent draws)."""
    drafted: list[int] = []
    checked: list[tuple[list[int], list[int]]] = []
    real_draw, real_sample = draft_extend.drawn_candidate, accept.sample

    def record_draw(head, logits, draw):  # type: ignore[no-untyped-def]
        drafted.extend(draw.positions.tolist())
        return real_draw(head, logits, draw)

    def record_verify(rows, info, at):  # type: ignore[no-untyped-def]
        checked.append((sorted(drafted), sorted(at.tolist())[:-1]))
        drafted.clear()
        return real_sample(rows, info, at)

    monkeypatch.setattr(draft_extend, "drawn_candidate", record_draw)
    monkeypatch.setattr(accept, "sample", record_verify)
    eng = Engine(model=small_target[0], device="cpu", speculative_algorithm="EAGLE",
                 speculative_draft_model_path=head_dir, speculative_num_steps=3,
                 speculative_eagle_topk=1, speculative_num_draft_tokens=4)  # fmt: skip
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=random.randrange(2**40),
                            ignore_eos=True)  # fmt: skip
    eng.generate([PROMPT], params)
    assert len(checked) >= 4
    for drafts, nodes in checked:
        assert len(drafts) == 3 and drafts == nodes

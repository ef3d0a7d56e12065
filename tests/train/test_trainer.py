"""The training step: its label selection equals boolean indexing, it waits for the device once
(a host read drains the GPU's queue, and the step is launched from the host), and compiled it
computes what it computes eagerly."""

from __future__ import annotations

import math

import pytest
import torch
from device_reads import device_read
from torch.utils._python_dispatch import TorchDispatchMode

from eagleserve.spec.head_loader import init_eagle_head
from eagleserve.train.batches import Batch
from eagleserve.train.features import IGNORE
from eagleserve.train.target import load_target
from eagleserve.train.trainer import TrainConfig, labelled_rows, train_step

pytestmark = pytest.mark.usefixtures("torch_threads")


def _batch(b: int, t: int, depths: int, width: int, vocab: int, g: torch.Generator) -> Batch:
    n, k = t + depths + 1, 4
    y = torch.randint(0, vocab, (b, n), generator=g)
    y[torch.rand(b, n, generator=g) < 0.4] = IGNORE  # prompts, padding, outside the vocabulary
    soft_ids = torch.randint(-1, vocab, (b, n, k), generator=g)
    soft_p = torch.softmax(torch.randn(b, n, k, generator=g), -1)
    x = torch.randint(0, vocab, (b, n), generator=g)
    f = torch.randn(b, n, width, generator=g)
    return Batch(x, f, y, torch.ones(b, n, dtype=torch.bool), soft_ids, soft_p)


def test_labelled_rows_equal_boolean_indexing() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    b, t, depths = 5, 13, 4
    batch = _batch(b, t, depths, 3, 50, g)
    keep = [torch.rand(b, t, generator=g) < 0.5 for _ in range(depths)]
    for mask in (None, keep):
        rows = labelled_rows(batch, depths, t, mask)
        for s, (bi, col) in enumerate(rows):
            lab = batch.y[:, s + 1 : s + 1 + t]
            sel = lab != IGNORE
            if mask is not None:
                sel &= mask[s]
            assert sel.sum() > 0
            assert torch.equal(batch.y[bi, col], lab[sel])
            # the same positions, in the same order, of any [B, t] tensor (the head's rows)
            rowid = torch.arange(b * t).view(b, t)
            assert torch.equal(rowid[bi, col - (s + 1)], rowid[sel])
            assert torch.equal(batch.soft_p[bi, col], batch.soft_p[:, s + 1 : s + 1 + t][sel])


class _DeviceReads(TorchDispatchMode):
    """Counts the ops that make the host wait for the device on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if device_read(func, args, kwargs) is not None:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("soft", [True, False])
def test_a_training_step_waits_for_the_device_once(tiny_model_dir: str, soft: bool) -> None:
    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head("EAGLE3", target, seed=int(torch.randint(0, 1000, ())))
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    depths, t = 3, 9
    vocab = head.lm_head.weight.shape[0]
    batch = _batch(2, t, depths, head.feature_size, vocab, g)
    cfg = TrainConfig(out_dir="", depths=depths, soft_labels=soft)
    with _DeviceReads() as mode:
        loss, metrics = train_step(head, batch, cfg, 0)
        loss.backward()
    assert mode.reads == ["nonzero"]
    assert torch.isfinite(loss) and loss > 0 and set(metrics) == {"acc0", "acc1", "acc2"}
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


def test_compiled_step_equals_eager(tiny_model_dir: str) -> None:
    """--enable-torch-compile changes how the step runs, not what it computes: the loss, the
    accuracies and every gradient match eager, on two batches of different lengths (the second
    runs the dynamic-shape graphs the first compiled). Depths >= 1 share one graph (their past
    padded to one length): three graphs in all, with depth 0's and the loss's."""
    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head("EAGLE3", target, seed=int(torch.randint(0, 1000, ())))
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    depths = 4
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    vocab = head.lm_head.weight.shape[0]
    params = [p for p in head.parameters() if p.requires_grad]
    for t in (9, 14):
        batch = _batch(2, t, depths, head.feature_size, vocab, g)
        results = []
        for compiled in (False, True):
            cfg = TrainConfig(out_dir="", depths=depths, soft_labels=True,
                              enable_torch_compile=compiled)  # fmt: skip
            loss, metrics = train_step(head, batch, cfg, 0)
            grads = torch.autograd.grad(loss, params)
            results.append((loss, metrics, grads))
        (l0, m0, g0), (l1, m1, g1) = results
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        assert set(m0) == set(m1)
        for k in m0:  # a near-tie's argmax may flip one row
            torch.testing.assert_close(m1[k], m0[k], atol=0.15, rtol=0)
        for a, b in zip(g1, g0, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 + 1e-6 * b.abs().max().item())
    assert stats["unique_graphs"] - before == 3


class _Clock:
    """time.time for the trainer: each batch costs `slow` seconds for the first `warm` steps
    (allocator, kernels, long batches), then `fast`."""

    def __init__(self, warm: int, slow: float, fast: float) -> None:
        self.now, self.steps, self.warm, self.slow, self.fast = 1000.0, 0, warm, slow, fast

    def time(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += self.slow if self.steps < self.warm else self.fast
        self.steps += 1


def test_a_budgeted_run_trains_until_its_budget(
    tiny_model_dir: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow first steps must not end the cosine schedule early: the run stops on its schedule
    with most of the budget used, not a third of it."""
    from eagleserve.train import trainer

    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head("EAGLE3", target, seed=int(torch.randint(0, 1000, ())))
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    depths, vocab = 2, head.lm_head.weight.shape[0]
    fast = float(torch.empty(()).uniform_(0.1, 0.3, generator=g))
    clock = _Clock(warm=20, slow=5 * fast, fast=fast)
    budget = 60 * fast * 5

    class Source:
        per_epoch = 50

        def batch(self, epoch: int, within: int) -> Batch:
            clock.advance()
            return _batch(2, 7, depths, head.feature_size, vocab, g)

    monkeypatch.setattr(trainer, "time", clock)
    cfg = TrainConfig(out_dir=str(tmp_path), depths=depths, epochs=100.0, save_every=10**6,
                      budget_s=budget, lr=1e-3)  # fmt: skip
    out = trainer.train_head(head, Source(), cfg)
    used = clock.now - 1000.0
    assert out["steps"] == out["total_steps"] < 50 * 100  # ended by the schedule, not the data
    assert 0.9 * budget <= used <= budget + fast, (used, budget, out["steps"])


def test_a_run_without_out_dir_writes_nothing_and_returns_its_metrics(
    tiny_model_dir: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`out_dir=None` (bench/train_step.py's timed runs): no checkpoint in the timed steps and
    nothing left on disk, yet the last step's metrics come back."""
    from eagleserve.train import trainer

    monkeypatch.chdir(tmp_path)
    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head("EAGLE3", target, seed=int(torch.randint(0, 1000, ())))
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    depths, vocab = 2, head.lm_head.weight.shape[0]
    steps = int(torch.randint(2, 6, (), generator=g))

    class Source:
        per_epoch = 50

        def batch(self, epoch: int, within: int) -> Batch:
            return _batch(2, 7, depths, head.feature_size, vocab, g)

    cfg = TrainConfig(out_dir=None, depths=depths, save_every=1, max_steps=steps)
    out = trainer.train_head(head, Source(), cfg)
    assert list(tmp_path.iterdir()) == []
    assert out["steps"] == steps and {"acc0", "acc1", "loss"} <= set(out)
    assert all(math.isfinite(out[k]) for k in ("acc0", "acc1", "loss")) and out["loss"] > 0
    cfg = TrainConfig(out_dir=str(tmp_path / "ck"), depths=depths, max_steps=steps)
    trainer.train_head(head, Source(), cfg)  # with a folder, the last step is checkpointed
    written = {p.name for p in (tmp_path / "ck").iterdir()}
    assert {"model.safetensors", "trainer_state.pt"} <= written


def test_out_of_device_memory_keeps_the_steps_done(
    tiny_model_dir: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A step that runs out of device memory (a long batch late in a run) ends training: the
    steps before it are checkpointed and their metrics returned with the failed step's number,
    the head as they left it; out of memory at the first step raises, saying what to lower."""
    from eagleserve.train import trainer

    target, _ = load_target(tiny_model_dir, "float32", 64)
    head = init_eagle_head("EAGLE3", target, seed=int(torch.randint(0, 1000, ())))
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    depths, vocab = 2, head.lm_head.weight.shape[0]
    fail_at = int(torch.randint(2, 6, (), generator=g))  # the step that runs out
    real_step = trainer.train_step

    def step_or_oom(head_, batch, cfg, step):  # noqa: ANN001, ANN202
        if step + 1 >= fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real_step(head_, batch, cfg, step)

    class Source:
        per_epoch = 50

        def batch(self, epoch: int, within: int) -> Batch:
            return _batch(2, 7, depths, head.feature_size, vocab, g)

    monkeypatch.setattr(trainer, "train_step", step_or_oom)
    cfg = TrainConfig(out_dir=str(tmp_path), depths=depths, save_every=10**6, lr=1e-3)
    out = trainer.train_head(head, Source(), cfg)
    assert out["steps"] == fail_at - 1 and out["out_of_memory_at_step"] == fail_at
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=False)
    assert state["step"] == fail_at - 1
    for k, v in head.state_dict().items():  # the checkpoint is the head as it stands
        assert torch.equal(state["head"][k], v)
    assert f"out of device memory at step {fail_at}" in capsys.readouterr().err
    fail_at = 1
    with pytest.raises(torch.OutOfMemoryError, match="nothing trained; lower --batch-size"):
        trainer.train_head(head, Source(), TrainConfig(out_dir=None, depths=depths))

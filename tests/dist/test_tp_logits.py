"""Tensor parallelism over gloo: TP=2 logits equal TP=1 logits within fp32 tolerance (the tiny
model with KV heads split, a tiny MQA model with its KV head replicated, SmolLM2 with its 3 KV
heads split 2 + 1, dense fp32 and packed int4), and sizes that cannot split a model get one
clear error before anything loads."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from tp_ranks import logits_of, run_ranks
from transformers import LlamaConfig, LlamaForCausalLM

from eagleserve.config import ModelConfig
from eagleserve.models.loader import default_gguf_path
from eagleserve.models.tp_shard import TpShard

pytestmark = pytest.mark.usefixtures("torch_threads")


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One KV head for 4 query heads, tied embeddings, an odd vocabulary (padded shards)."""
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    path = str(tmp_path_factory.mktemp("mqa"))
    model.save_pretrained(path)
    return path


def _prompt(vocab: int, n: int) -> list[int]:
    return [random.randrange(3, vocab) for _ in range(n)]


def test_tp2_logits_equal_tp1(tiny_model_dir: str, mqa_dir: str, smollm2_dir: str) -> None:
    smol_prompt, smol_next = _prompt(49152, 13), random.randrange(3, 49152)
    cases = [
        (tiny_model_dir, None, _prompt(256, 11), random.randrange(3, 256)),
        (mqa_dir, None, _prompt(101, 9), random.randrange(3, 101)),
        (smollm2_dir, None, smol_prompt, smol_next),
        (smollm2_dir, default_gguf_path(), smol_prompt, smol_next),
    ]
    tp2 = run_ranks(2, functools.partial(logits_of, cases))
    tp1 = logits_of(cases)
    for name, a, b, (d, _, p, _) in zip(["tiny", "mqa", "smollm2 fp32"], tp1, tp2, cases):
        assert a.shape == b.shape == (len(p) + 1, ModelConfig.from_dir(d).vocab_size), name
        # fp32 sums in another order (the row-parallel partial sums) and nothing else.
        err = (a - b).abs().max().item()
        assert err <= 1e-4 * max(1.0, a.abs().max().item()), f"{name}: max |diff| {err}"
        assert not torch.equal(a[0], a[-1]), name  # the decode step saw new input
    # Packed int4: activations enter the kernel in bf16 and each rank's o_proj / down_proj
    # partial sum comes out rounded to bf16 (one rounding per rank instead of one), so TP=2
    # is another bf16 rounding of the same model: its distance to the fp32 model must be of
    # the order of TP=1's, not fp32-close to TP=1.
    dense = tp1[2]
    own = (tp1[3] - dense).abs().mean().item()
    split = (tp2[3] - dense).abs().mean().item()
    assert split <= 2 * own, f"packed: TP=2 {split} vs TP=1 {own} from the fp32 logits"


def test_sizes_that_cannot_split_are_one_clear_error(smollm2_dir: str) -> None:
    smol = ModelConfig.from_dir(smollm2_dir)  # 9 query heads, 3 KV heads, MLP 1536
    with pytest.raises(ValueError, match=r"--tp-size 4 does not fit the model's 3 KV heads"):
        TpShard.plan(smol, 0, 4, packed=False)
    with pytest.raises(ValueError, match=r"--tp-size 12 is more ranks than the model's 9"):
        TpShard.plan(smol, 0, 12, packed=False)
    # Splits that work: uneven KV heads (2 + 1), and replicated KV heads (3 x 3 ranks).
    two = [TpShard.plan(smol, r, 2, packed=True) for r in range(2)]
    assert [len(s.kv_heads) for s in two] == [2, 1] and [len(s.q_heads) for s in two] == [6, 3]
    nine = [TpShard.plan(smol, r, 9, packed=False) for r in range(9)]
    assert [s.kv_heads.start for s in nine] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert sorted(h for s in nine for h in s.q_heads) == list(range(9))
    odd = ModelConfig.from_hf({"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48,
                               "num_hidden_layers": 1, "num_attention_heads": 2,
                               "num_key_value_heads": 2})  # fmt: skip
    with pytest.raises(ValueError, match=r"MLP width 48 does not split into 2 parts of whole"):
        TpShard.plan(odd, 0, 2, packed=True)

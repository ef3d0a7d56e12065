"""EAGLE3 heads of several layers, in vLLM's layout (`midlayer`, then plain decoder layers
`layers.1` ..): they load and save, their paged forward is the dense reference's, and the draft
extend after a verify (every row through every layer, logits of each request's last row) gives a
request's drafts and head K/V as a dense forward over its accepted rows does, on the CPU's
compacted rows and on an accelerator's fixed-shape path alike."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_head_formats import (  # noqa: F401 (fixtures)
    CPU,
    DRAFT_IDS,
    H,
    V,
    eagle3_tensors,
    head_config,
    target_dir_fixture,
    target_fixture,
    upper_layer_tensors,
    write_head,
)
from head_reference import head_inputs, paged_forward, ref_eagle3, roundtrip

from eagleserve.layers.attention import TorchAttnBackend
from eagleserve.layers.forward_batch import ForwardBatch, HostLens
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.spec.draft_extend import last_rows_forward
from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head

Tensors = dict[str, torch.Tensor]


def _two_layer_head(tmp_path, target: LlamaForCausalLM) -> tuple[EagleHead, Tensors, str]:
    seed = int(torch.randint(0, 10**6, ()))
    cfg = head_config("LlamaForCausalLMEagle3", draft_vocab_size=len(DRAFT_IDS),
                      num_hidden_layers=2)  # fmt: skip
    tensors = {**eagle3_tensors(DRAFT_IDS, seed), **upper_layer_tensors(1, seed + 1)}
    path = write_head(str(tmp_path / "head"), cfg, tensors)
    return load_eagle_head(path, "EAGLE3", target, CPU, torch.float32), tensors, path


def test_a_two_layer_head_loads_and_matches_the_dense_reference(
    tmp_path, target: LlamaForCausalLM
) -> None:
    head, tensors, path = _two_layer_head(tmp_path, target)
    assert head.config.num_hidden_layers == 2 and len(head.upper_layers) == 1
    ids, feats = head_inputs(3 * H, H)  # target features, then fed-back draft features
    logits, nxt = paged_forward(head, ids, feats)
    ref_logits, ref_next = ref_eagle3(tensors, target, ids, feats)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt, ref_next, atol=1e-5, rtol=1e-5)
    # The second layer changes the drafts: a one-layer reference is not what ran.
    one_layer = {k: v for k, v in tensors.items() if not k.startswith("layers.1.")}
    assert not torch.allclose(ref_eagle3(one_layer, target, ids, feats)[0], logits, atol=1e-3)
    roundtrip(head, tmp_path / "out", target)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 2
    # A checkpoint that lacks its second layer's tensors says which.
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    write_head(str(tmp_path / "short"), cfg, one_layer)
    with pytest.raises(KeyError, match=r"layers\.1\.self_attn\.q_proj\.weight"):
        load_eagle_head(str(tmp_path / "short"), "EAGLE3", target, CPU, torch.float32)


def test_layer_counts_a_head_cannot_have(target: LlamaForCausalLM, tmp_path) -> None:
    with pytest.raises(ValueError, match="EAGLE heads have one layer"):
        init_eagle_head("EAGLE", target, num_hidden_layers=2)
    cfg = head_config("LlamaForCausalLMEagle3", draft_vocab_size=len(DRAFT_IDS),
                      num_hidden_layers=0)  # fmt: skip
    write_head(str(tmp_path), cfg, eagle3_tensors(DRAFT_IDS))
    with pytest.raises(ValueError, match="at least 1"):
        load_eagle_head(str(tmp_path), "EAGLE3", target, CPU, torch.float32)


class _Pools:
    """A fresh draft KV pool of the head's layers and a request table whose request r holds
    slots 1 + r * width + [0, width) (slot 0 is the one nobody reads)."""

    def __init__(self, head: EagleHead, bs: int, width: int) -> None:
        cfg = head.config
        self.kv = TokenToKVPool(1 + bs * width, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                cfg.head_dim, torch.float32, CPU)  # fmt: skip
        r2t = ReqToTokenPool(bs, 16, CPU)
        self.slots = 1 + torch.arange(bs * width).view(bs, width)
        r2t.req_to_token[:, :width] = self.slots
        self.backend = TorchAttnBackend(r2t.req_to_token, cfg.head_dim**-0.5)

    def extend(self, ids: torch.Tensor, locs: torch.Tensor, pos: torch.Tensor,
               extend_lens: torch.Tensor, host: HostLens) -> ForwardBatch:  # fmt: skip
        bs = extend_lens.shape[0]
        return ForwardBatch(mode="extend", input_ids=ids, positions=pos, out_cache_loc=locs,
                            req_pool_indices=torch.arange(bs), prefix_lens=torch.zeros_like(
                                extend_lens), extend_lens=extend_lens, host=host,
                            kv_pool=self.kv, attn_backend=self.backend)  # fmt: skip

    def kv_at(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.stack([b[slots] for b in (*self.kv.k_buffer, *self.kv.v_buffer)])


def test_the_draft_extend_of_a_two_layer_head(tmp_path, target: LlamaForCausalLM) -> None:
    """Each request accepted a[r] of a path of `width` rows. The CPU's extend (accepted rows
    only, `last_rows` given) and the accelerator's (all `width` rows, those past a[r] with
    token -1, masked by `mask_path_rows`) both give each request's last-row drafts and next
    features as the dense reference over its accepted rows, and the same head K/V in every
    accepted row's slot of both layers."""
    head, tensors, _ = _two_layer_head(tmp_path, target)
    bs, width = 3, 4
    a = torch.randint(1, width + 1, (bs,))
    a[0] = width - 1  # at least one request with rows past its accept length
    ids = torch.randint(0, V, (bs, width))
    feats = torch.randn(bs, width, 3 * H)
    pos = torch.arange(width).expand(bs, width)
    valid = torch.arange(width)[None, :] < a[:, None]

    compact = _Pools(head, bs, width)
    fb = compact.extend(ids[valid], compact.slots[valid], pos[valid], a,
                        HostLens(width, width, False))  # fmt: skip
    with torch.no_grad():
        got = last_rows_forward(head, fb, feats[valid], torch.cumsum(a, 0) - 1)

    fixed = _Pools(head, bs, width)
    path_ids = torch.where(valid, ids, -1)  # the verify leaves rejected nodes as -1
    fb = fixed.extend(path_ids.reshape(-1), fixed.slots.reshape(-1), pos.reshape(-1), a,
                      HostLens(width, width, width == 1))  # fmt: skip
    with torch.no_grad():
        got_fixed = last_rows_forward(head, fb, feats.reshape(-1, 3 * H), None)

    for r in range(bs):
        n = int(a[r])
        ref_logits, ref_next = ref_eagle3(tensors, target, ids[r, :n], [feats[r, :n]])
        for logits, nxt in (got, got_fixed):
            torch.testing.assert_close(logits[r], ref_logits[-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(nxt[r], ref_next[-1], atol=1e-5, rtol=1e-5)
    accepted = compact.slots[valid]
    torch.testing.assert_close(fixed.kv_at(accepted), compact.kv_at(accepted), atol=1e-5, rtol=1e-5)
    assert compact.kv_at(accepted)[2:].abs().sum() > 0  # layer 1's K/V were written

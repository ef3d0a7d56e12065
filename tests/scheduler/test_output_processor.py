"""scheduler/output_processor.py: a tree verify's accepted paths reorder the host's copy of the
req_to_token rows exactly as they reordered the device's, for the requests that go on; stop
strings end a request where the server cuts its text."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from eagleserve.core import FinishReason, GenerationBatchResult, Req, SamplingParams
from eagleserve.mem_cache.kv_cache import ReqToTokenPool
from eagleserve.scheduler.output_processor import (
    StopChecker,
    append_tokens,
    commit_tree_paths_host,
    response_text,
    text_before_stop,
    text_ids,
)
from eagleserve.server.detokenizer import IncrementalDetokenizer
from eagleserve.spec.accept import commit_tree_path


def random_paths(bs: int, n: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """[bs, depth + 1] accepted node per path step: node 0 (the root) first, then distinct
    increasing nodes, -1 past a random path length."""
    paths = torch.full((bs, depth + 1), -1, dtype=torch.long)
    for b in range(bs):
        length = int(torch.randint(1, depth + 2, (1,), generator=gen))
        nodes = torch.randperm(n - 1, generator=gen)[: length - 1].sort().values + 1
        paths[b, 0] = 0
        paths[b, 1:length] = nodes
    return paths


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# A synchronous forward's result stays on its device (the overlap path copies it to the host).
@pytest.mark.parametrize("device", DEVICES)
def test_the_hosts_rows_follow_the_devices_tree_paths(device: str) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    bs, n, depth, width = 5, 8, 3, 40
    pool = ReqToTokenPool(bs + 2, width, torch.device(device))
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    slots = torch.randperm(2000, generator=gen)[: (bs + 2) * width].view(bs + 2, width) + 1
    pool.req_to_token.copy_(slots)
    pool.req_to_token_host.copy_(slots)
    reqs = []
    for b in range(bs):
        req = Req(f"r{b}", [1, 2, 3], SamplingParams(max_new_tokens=8))
        req.req_pool_idx = int(rows[b])
        req.kv_committed_len = int(torch.randint(3, width - n, (1,), generator=gen))
        reqs.append(req)
    reqs[1].finish_reason = FinishReason.STOP  # finished while the verify ran: left as it was
    partial = reqs[3]  # a request part-way through its prefill commits nothing
    paths = random_paths(bs, n, depth, gen)
    paths[0, :2], paths[0, 2:] = torch.tensor([0, n - 1]), -1  # at least one row moves a node
    lens = torch.tensor([r.kv_committed_len for r in reqs])
    on = torch.device(device)
    commit_tree_path(pool.req_to_token, rows.to(on), lens.to(on), paths.to(on), n)  # the verify
    result = GenerationBatchResult(torch.zeros(bs, depth + 1, dtype=torch.long, device=on))
    result.tree_path, result.tree_nodes = paths.to(on), n
    commit_tree_paths_host(pool, reqs, result, partial)
    for b, req in enumerate(reqs):
        host, on_device = pool.req_to_token_host[rows[b]], pool.req_to_token[rows[b]].cpu()
        if req.finished or req is partial:
            assert torch.equal(host, slots[rows[b]])
            continue
        assert torch.equal(host, on_device)
        path = paths[b][paths[b] >= 0]  # the accepted nodes now sit at L, L + 1, ...
        L = req.kv_committed_len
        assert torch.equal(host[L : L + len(path)], slots[rows[b], L + path])
    assert not torch.equal(pool.req_to_token_host, slots)


def finish_at(checker: StopChecker, ids: list[int], params: SamplingParams) -> int:
    """How many of `ids` a request takes, fed one decode step at a time, before it finishes."""
    req = Req("r", [1, 2, 3], params)
    for i in range(0, len(ids), 2):  # two at a time, as a verify commits them
        append_tokens(req, ids[i : i + 2], checker)
        if req.finished:
            break
    return len(req.output_ids)


def server_text(
    tok: Any, ids: list[int], stop: list[str], min_tokens: int, include: bool = False
) -> str:
    """The text the server streams for `ids`, one token at a time."""
    detok = IncrementalDetokenizer(tok, stop, min_tokens=min_tokens, include_stop_str=include)
    return "".join([detok.add([i]) for i in ids] + [detok.finish()])


def check_stop(tok: Any, ids: list[int], stop: list[str], min_tokens: int) -> None:
    """The engine stops at the first token whose response text has a stop string ending after
    the text of the first min_tokens tokens, and its text (offline `Engine`) is the server's."""
    params = SamplingParams(max_new_tokens=len(ids), stop=stop, min_tokens=min_tokens)
    head = len(response_text(tok, ids[:min_tokens]))

    def stops_at(k: int) -> bool:
        text = response_text(tok, ids[:k])
        return any(text.find(s, max(0, head - len(s) + 1)) >= 0 for s in stop)

    want = next(k for k in range(min_tokens + 1, len(ids) + 1) if stops_at(k))
    assert finish_at(StopChecker(tok), ids, params) == want
    for include in (False, True):  # vLLM's include_stop_str_in_output: cut after it
        cut = SamplingParams(stop=stop, min_tokens=min_tokens, include_stop_str_in_output=include)
        offline = text_before_stop(tok, ids[:want], cut)
        assert offline == server_text(tok, ids[:want], stop, min_tokens, include)
        assert any(offline.endswith(s) for s in stop) == include


@pytest.mark.parametrize("draw", range(4))
def test_a_stop_string_after_min_tokens_ends_the_request_where_the_text_is_cut(
    smollm2_dir: str, draw: int
) -> None:
    """Even when the same string also occurs just before, inside the first min_tokens tokens
    (fresh words each draw)."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rng = random.Random()
    words = [rng.choice([" one", " two", " three", " four"]) + rng.choice([",", ""])
             for _ in range(12)]  # fmt: skip
    ids = tok.encode("".join(words) + ", end", add_special_tokens=False)
    for min_tokens in range(len(ids) - 2):
        try:
            check_stop(tok, ids, [","], min_tokens)
        except AssertionError as exc:
            raise AssertionError(f"words {words}, min_tokens {min_tokens}") from exc


def test_a_stop_string_across_a_special_token_counts_as_the_response_shows_it(
    smollm2_dir: str,
) -> None:
    """A response's text leaves special tokens out, so "\\n<|im_end|>\\n" reads "\\n\\n"."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rng = random.Random()
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    words = " ".join(rng.choice(["sea", "moon", "bread", "rain"]) for _ in range(6))
    ids = enc(words + "\n") + [tok.convert_tokens_to_ids("<|im_end|>")] + enc("\nok, more")
    check_stop(tok, ids, ["\n\n"], 0)
    assert response_text(tok, ids).startswith(words + "\n\nok")
    # With skip_special_tokens false (vLLM's field) the text shows the token, and a stop string
    # is found in that text: "\n\n" no longer matches there, "<|im_end|>\n" does.
    shown = SamplingParams(max_new_tokens=len(ids), stop=["\n\n"], skip_special_tokens=False)
    assert finish_at(StopChecker(tok), ids, shown) == len(ids)
    shown.stop = ["<|im_end|>\n"]
    want = len(enc(words + "\n")) + 2  # the special token, then the "\n" that completes it
    assert finish_at(StopChecker(tok), ids, shown) == want
    assert text_before_stop(tok, ids[:want], shown) == words + "\n"


def test_the_stop_token_that_ends_a_response_is_in_its_text_only_when_asked() -> None:
    """As vLLM: the EOS or stop id that ended a request is not in its text unless
    include_stop_str_in_output; tokens before it always are."""
    rng = random.Random()
    ids = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
    for include in (False, True):
        params = SamplingParams(include_stop_str_in_output=include)
        assert text_ids(ids, ids[-1], params) == (ids if include else ids[:-1])
        assert text_ids(ids, "stop string", params) == ids  # cut by text, not by token
        assert text_ids(ids, None, params) == ids

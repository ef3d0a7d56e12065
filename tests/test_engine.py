"""The offline `Engine`: greedy parity with transformers, sampling parameters, stop conditions
(request validation: test_engine_errors.py). Every engine is checked after each test for
leaked KV / request slots (conftest `check_pools_free`)."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
from collections.abc import Callable

import pytest
import torch
from conftest import TINY_BOS, TINY_EOS, add_bos_to_tokenizer, random_prompts
from engine_fixtures import greedy, sampled, tiny_engine_fixture, tiny_fixture  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagleserve import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_threads")

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
    "In machine learning, overfitting means",
    "<|im_start|>user\nWrite a haiku about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
]


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def step_logits(hf: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Teacher-forced transformers logits [len(out), V]: row i is the distribution of out[i]."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]


# ---- greedy parity with transformers ------------------------------------------------------------


def test_greedy_matches_transformers_generate(
    smollm2_dir: str, make_engine: Callable[..., Engine]
) -> None:
    """8 prompts x 64 new tokens on SmolLM2, batched in one call, equal HF greedy one by one."""
    engine = make_engine(smollm2_dir, max_running_requests=8, max_total_tokens=2048)
    outs = engine.generate(SMOL_PROMPTS, greedy(64))

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    eos = sorted(engine.scheduler.eos_token_ids)
    for prompt, out in zip(SMOL_PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)  # as the Engine encodes a text (SmolLM2's adds no BOS)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[0, len(ids) :].tolist()
        assert out["token_ids"] == ref, f"prompt {prompt!r}"
        stopped = ref[-1] in eos
        assert out["finish_reason"] == ("stop" if stopped else "length")
        assert out["text"] == tok.decode(ref, skip_special_tokens=True)
    assert sum(len(o["token_ids"]) for o in outs) > 4 * 64  # most ran the full length


def test_stop_string_inside_a_token_cuts_text(
    smollm2_dir: str, make_engine: Callable[..., Engine]
) -> None:
    """A stop string that starts mid-token: text ends right before it; finish_reason "stop"."""
    engine = make_engine(smollm2_dir, max_running_requests=2, max_total_tokens=512)
    prompt = "Once upon a time, in a small village by the sea,"
    full = engine.generate(prompt, greedy(32, ignore_eos=True))[0]
    tok, ids = engine.tokenizer, full["token_ids"]
    # Characters 2..4 of a token of 4+ characters, not seen earlier in the text: a stop string
    # that starts inside a token.
    cut = -1
    for i in range(2, len(ids) - 1):
        piece = tok.decode(ids[i : i + 1])
        start = len(tok.decode(ids[:i])) + 1
        if len(piece) >= 4 and full["text"].find(piece[1:4]) == start:
            stop, cut = piece[1:4], start
            break
    assert cut > 0, full["text"]
    out = engine.generate(prompt, greedy(32, ignore_eos=True, stop=[stop]))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full["text"][:cut]
    assert out["token_ids"] == full["token_ids"][: len(out["token_ids"])]
    assert len(out["token_ids"]) < len(full["token_ids"])


def test_min_tokens_keeps_a_stop_string_of_the_first_tokens_in_the_text(
    smollm2_dir: str, make_engine: Callable[..., Engine]
) -> None:
    """A stop string inside the first min_tokens tokens stays in the text; the first one after
    them ends the request, and the text is cut before it (as the server cuts it)."""
    engine = make_engine(smollm2_dir, max_running_requests=2, max_total_tokens=512)
    prompt = random.choice(SMOL_PROMPTS)
    full = engine.generate(prompt, greedy(48, ignore_eos=True))[0]
    tok, ids, text = engine.tokenizer, full["token_ids"], full["text"]
    # The first character that recurs after at least 3 tokens, with min_tokens between the two.
    for k in range(3, len(ids) - 3):
        head = tok.decode(ids[:k])
        stop = next((c for c in head[1:] if c in text[len(head) :]), None)
        if stop is not None and text.find(stop) < len(head):
            break
    else:
        pytest.fail(f"no character recurs in {text!r}")
    out = engine.generate(prompt, greedy(48, ignore_eos=True, stop=[stop], min_tokens=k))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.find(stop, len(head))], (stop, k)
    assert out["token_ids"] == ids[: len(out["token_ids"])]


# ---- sampling -----------------------------------------------------------------------------------


def test_same_seed_same_tokens_alone_and_batched(tiny: Engine) -> None:
    prompt = random_prompts(1, [15], seed=1)[0]
    alone = tiny.generate([prompt], sampled(48, seed=1234))[0]["token_ids"]
    again = tiny.generate([prompt], sampled(48, seed=1234))[0]["token_ids"]
    assert alone == again
    # Batched with other requests (sampled with other seeds, greedy, other lengths), not first.
    others = random_prompts(5, [3, 30, 9, 22, 6], seed=2)
    params = [sampled(48, 7), greedy(20), sampled(48, 1234), sampled(48, None), greedy(48)]
    batch = tiny.generate(
        others[:3] + [prompt] + others[3:], params[:3] + [sampled(48, seed=1234)] + params[3:]
    )
    assert batch[3]["token_ids"] == alone
    # A different seed gives different tokens; so does no seed, twice.
    other_seed = tiny.generate([prompt], sampled(48, seed=1235))[0]["token_ids"]
    assert other_seed != alone
    unseeded = tiny.generate([prompt, prompt], sampled(48, seed=None))
    assert unseeded[0]["token_ids"] != unseeded[1]["token_ids"]


def test_random_seed_repeats_a_run_of_unseeded_requests(
    tiny_model_dir: str, make_engine: Callable[..., Engine]
) -> None:
    """--random-seed: a fresh engine with the same seed answers the same unseeded sampled
    requests, sent in the same order, with the same tokens; another seed with others."""
    prompts = random_prompts(3, [7, 19, 12], seed=random.randrange(2**31))
    random_seed = random.randrange(2**31)

    def run(seed: int) -> list[list[int]]:
        eng = make_engine(tiny_model_dir, random_seed=seed)
        outs = [eng.generate([p], sampled(24, seed=None))[0]["token_ids"] for p in prompts]
        eng.close()
        return outs

    first = run(random_seed)
    assert run(random_seed) == first, f"random_seed {random_seed}"
    assert run(random_seed + 1) != first


def test_top_k_1_and_tiny_temperature_equal_greedy(tiny: Engine) -> None:
    prompts = random_prompts(4, seed=3)
    want = [o["token_ids"] for o in tiny.generate(prompts, greedy(32, ignore_eos=True))]
    for params in (
        sampled(32, seed=5, top_k=1),
        SamplingParams(max_new_tokens=32, temperature=1e-3, seed=5, ignore_eos=True),
    ):
        got = [o["token_ids"] for o in tiny.generate(prompts, params)]
        assert got == want, params


def _allowed(probs: torch.Tensor, token: int, top_k: int, top_p: float, min_p: float) -> bool:
    """Reference rule, written independently of eagleserve's sampler (ties: lenient 1e-6)."""
    p = probs[token]
    if top_k > 0 and int((probs > p + 1e-6).sum()) >= top_k:
        return False
    if top_p < 1.0 and float(probs[probs > p + 1e-6].sum()) >= top_p + 1e-5:
        return False
    return not (min_p > 0 and float(p) < min_p * float(probs.max()) - 1e-6)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 3, 1.0, 0.0), (1.0, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.3), (0.7, 5, 0.8, 0.1)],
    ids=["top_k", "top_p", "min_p", "combined"],
)
def test_sampled_tokens_stay_in_the_allowed_set(
    tiny: Engine,
    tiny_hf: torch.nn.Module,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> None:
    prompts = random_prompts(12, seed=4)
    params = [
        SamplingParams(
            max_new_tokens=32,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=100 + i,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    outs = tiny.generate(prompts, params)
    excluded_mass = 0.0
    distinct = set()
    for prompt, out in zip(prompts, outs, strict=True):
        logits = step_logits(tiny_hf, prompt, out["token_ids"])
        probs = torch.softmax(logits / temperature, dim=-1)
        for i, tok in enumerate(out["token_ids"]):
            assert _allowed(probs[i], tok, top_k, top_p, min_p), (
                f"token {tok} (p={float(probs[i, tok]):.3f}, max={float(probs[i].max()):.3f}) "
                f"is outside the allowed set"
            )
            allowed = torch.tensor(
                [_allowed(probs[i], t, top_k, top_p, min_p) for t in range(probs.shape[1])]
            )
            excluded_mass += float(probs[i][~allowed].sum())
            distinct.add((tuple(prompt), i, tok))
    # The restriction matters: unrestricted sampling would have left the set many times...
    assert excluded_mass > 20, excluded_mass
    # ...and the sampler still samples (it is not greedy in disguise).
    greedy_outs = tiny.generate(prompts, greedy(32, ignore_eos=True))
    assert (
        sum(o["token_ids"] != g["token_ids"] for o, g in zip(outs, greedy_outs, strict=True)) >= 10
    )


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_first_token_distribution_follows_temperature(
    tiny: Engine, tiny_hf: torch.nn.Module, temperature: float
) -> None:
    """1000 seeded one-token samples of one prompt follow softmax(logits / T).

    Compared as total variation over the 6 likeliest tokens plus an "everything else" bucket.
    """
    prompt = random_prompts(1, [12], seed=6)[0]
    n = 1000
    params = [
        SamplingParams(max_new_tokens=1, temperature=temperature, seed=1000 + i) for i in range(n)
    ]
    outs = tiny.generate([prompt] * n, params)
    logits = step_logits(tiny_hf, prompt, [0])[0].double()
    top = logits.topk(6).indices

    def buckets(p: torch.Tensor) -> torch.Tensor:
        return torch.cat([p[top], (1 - p[top].sum()).view(1)])

    counts = torch.bincount(torch.tensor([o["token_ids"][0] for o in outs]), minlength=256)
    emp = buckets(counts.double() / n)
    want = buckets(torch.softmax(logits / temperature, -1))
    other = buckets(torch.softmax(logits / (0.5 if temperature == 1.0 else 1.0), -1))
    tv = float((emp - want).abs().sum() / 2)
    tv_other = float((emp - other).abs().sum() / 2)
    assert tv < 0.05, f"TV to softmax(logits/{temperature}) is {tv:.3f}"
    assert tv_other > 0.1, (tv, tv_other)  # the check tells the temperatures apart


# ---- stop conditions ----------------------------------------------------------------------------


def _prompt_without_specials(engine: Engine, length: int, n: int, seed: int) -> list[int]:
    """A random prompt whose greedy continuation (n tokens, EOS ignored) has no special token
    (ids 0..2), so it neither stops at the tiny model's EOS nor loses characters in the text."""
    for s in range(seed, seed + 50):
        prompt = random_prompts(1, [length], seed=s)[0]
        out = engine.generate([prompt], greedy(n, ignore_eos=True))[0]["token_ids"]
        if min(out) > TINY_EOS:
            return prompt
    raise AssertionError("every prompt's continuation had a special token")


def _first_new(tokens: list[int], min_index: int) -> int:
    """Index >= min_index of a token that does not occur earlier in `tokens`."""
    for i in range(min_index, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError("no fresh token")


def test_eos_and_ignore_eos(
    tiny_model_dir: str, tmp_path: object, make_engine: Callable[..., Engine]
) -> None:
    base = make_engine(tiny_model_dir, max_running_requests=2, max_total_tokens=256)
    prompt = _prompt_without_specials(base, 10, 40, seed=7)
    full = base.generate([prompt], greedy(40, ignore_eos=True))[0]["token_ids"]
    assert TINY_EOS not in full
    k = _first_new(full, 4)
    # The same weights with full[k] as the config's EOS token.
    eos_dir = os.path.join(str(tmp_path), "eos_model")
    shutil.copytree(tiny_model_dir, eos_dir)
    with open(os.path.join(eos_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = full[k]
    with open(os.path.join(eos_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    engine = make_engine(eos_dir, max_running_requests=2, max_total_tokens=256)
    out = engine.generate([prompt], greedy(40))[0]
    assert out["token_ids"] == full[: k + 1]
    assert out["finish_reason"] == "stop"
    out = engine.generate([prompt], greedy(40, ignore_eos=True))[0]
    assert out["token_ids"] == full and out["finish_reason"] == "length"


def test_a_text_prompt_gets_the_tokenizers_bos(
    tiny_model_dir: str, tmp_path: object, make_engine: Callable[..., Engine]
) -> None:
    """As vLLM's and SGLang's offline engines: a text is encoded with the tokenizer's special
    tokens, so a Llama-style tokenizer's BOS reaches the model."""
    bos_dir = os.path.join(str(tmp_path), "bos")
    shutil.copytree(tiny_model_dir, bos_dir)
    add_bos_to_tokenizer(bos_dir)
    engine = make_engine(bos_dir, max_running_requests=2, max_total_tokens=256)
    texts = ["".join(random.choices("abcdefgh xyz", k=random.randint(3, 12))) for _ in range(2)]
    ids = [[3 + ord(c) - 32 for c in t] for t in texts]  # the char tokenizer's ids
    assert engine.tokenizer.encode(texts[0], add_special_tokens=False) == ids[0]
    by_text = engine.generate(texts, greedy(8))
    with_bos = engine.generate([[TINY_BOS, *p] for p in ids], greedy(8))
    assert [o["token_ids"] for o in by_text] == [o["token_ids"] for o in with_bos]


def test_flush_cache_empties_the_prefix_cache(tiny: Engine) -> None:
    prompt = [random.randrange(3, 250) for _ in range(random.randint(30, 60))]
    first = tiny.generate([prompt], greedy(4))
    hits = tiny.stats().prefix_cache_hit_tokens_total
    tiny.generate([prompt], greedy(4))
    assert tiny.stats().prefix_cache_hit_tokens_total > hits  # cached
    assert tiny.flush_cache() >= len(prompt) // 2
    assert tiny.stats().kv_cached_tokens == 0 and tiny.flush_cache() == 0
    hits = tiny.stats().prefix_cache_hit_tokens_total
    assert tiny.generate([prompt], greedy(4)) == first
    assert tiny.stats().prefix_cache_hit_tokens_total == hits  # computed again


def test_stop_token_ids(tiny: Engine) -> None:
    prompt = random_prompts(1, [9], seed=8)[0]
    full = tiny.generate([prompt], greedy(40, ignore_eos=True))[0]["token_ids"]
    k = _first_new(full, 5)
    # ignore_eos does not disable stop_token_ids.
    for ignore_eos in (False, True):
        out = tiny.generate(
            [prompt], greedy(40, ignore_eos=ignore_eos, stop_token_ids=[full[k], 255])
        )[0]
        assert out["token_ids"] == full[: k + 1]
        assert out["finish_reason"] == "stop"
    # The stop token's text is in the response only when asked (vLLM's rule).
    decode = tiny.tokenizer.decode
    for include in (False, True):
        asked = greedy(40, stop_token_ids=[full[k]], include_stop_str_in_output=include)
        out = tiny.generate([prompt], asked)[0]
        assert out["text"] == decode(full[: k + include], skip_special_tokens=True)


def test_stop_strings(tiny: Engine) -> None:
    prompt = _prompt_without_specials(tiny, 11, 48, seed=9)
    full = tiny.generate([prompt], greedy(48, ignore_eos=True))[0]
    text = full["text"]
    assert len(text) == 48  # the tiny tokenizer: one character per token
    # A 3-character stop string whose first occurrence starts at position 10 or later.
    k = next(i for i in range(10, 40) if text.find(text[i : i + 3]) == i)
    stop = text[k : k + 3]
    out = tiny.generate([prompt], greedy(48, ignore_eos=True, stop=["\x00never", stop]))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:k]
    assert out["token_ids"] == full["token_ids"][: k + 3]
    # A stop string present only in the prompt does not stop the output.
    absent = next(c * 2 for c in "abcdefghij" if c * 2 not in text)
    prompt_with_stop = tiny.tokenizer.encode(absent) + prompt
    out = tiny.generate([prompt_with_stop], greedy(8, ignore_eos=True, stop=[absent]))[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 8


def test_max_new_tokens_gives_length(tiny: Engine) -> None:
    prompts = random_prompts(3, seed=10)
    outs = tiny.generate(prompts, [greedy(n, ignore_eos=True) for n in (1, 7, 19)])
    assert [len(o["token_ids"]) for o in outs] == [1, 7, 19]
    assert all(o["finish_reason"] == "length" for o in outs)


def test_close_ends_the_overlap_forward_thread(
    tiny_model_dir: str, make_engine: Callable[..., Engine]
) -> None:
    """A closed engine leaves no thread behind: engines built one after another in a process
    (a bench, a notebook) do not pile up forward threads holding their predecessors' state."""
    import threading

    def forward_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("eagleserve-fwd")}

    before = forward_threads()
    eng = make_engine(tiny_model_dir, max_running_requests=2, max_total_tokens=256,
                      disable_overlap_schedule=False)  # fmt: skip
    prompt = random_prompts(1, seed=int.from_bytes(os.urandom(2), "little"))
    want = eng.generate(prompt, greedy(5, ignore_eos=True))[0]["token_ids"]
    assert len(want) == 5 and forward_threads() - before
    eng.close()
    assert not forward_threads() - before
    eng.close()  # again: nothing to do


def test_generate_takes_each_prompts_priority(
    tiny_model_dir: str, tiny: Engine, make_engine: Callable[..., Engine]
) -> None:
    """vLLM's `priority=` argument: with priority scheduling the answers are those of an engine
    without it (one slot: the prompts run one at a time, in priority order); without it a
    priority is refused naming the flag, as a mismatched list is."""
    rng = random.Random()
    prompts = random_prompts(5, seed=rng.randrange(1 << 20))
    params = greedy(12, ignore_eos=True)
    want = [r["token_ids"] for r in tiny.generate(prompts, params)]
    eng = make_engine(tiny_model_dir, max_running_requests=1, enable_priority_scheduling=True,
                      priority_scheduling_preemption_threshold=0)  # fmt: skip
    got = eng.generate(prompts, params, priority=[rng.randint(-3, 3) for _ in prompts])
    assert [r["token_ids"] for r in got] == want
    with pytest.raises(ValueError, match="enable-priority-scheduling"):
        tiny.generate(prompts[:1], params, priority=[1])
    with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
        eng.generate(prompts[:2], params, priority=[1])


def test_start_and_stop_profile_trace_the_generate_steps(tiny: Engine, tmp_path: str) -> None:
    """vLLM's `LLM.start_profile` / `stop_profile`: the trace written holds a span per step of
    the generate call between them."""
    path = tiny.start_profile(str(tmp_path))
    tiny.generate(random_prompts(2, seed=random.randrange(99)), greedy(5, ignore_eos=True))
    assert tiny.stop_profile() == path
    with gzip.open(path, "rt") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    assert names.count("eagleserve.step") >= 5  # a prefill and the decodes, at the least
    with pytest.raises(RuntimeError, match="not running"):
        tiny.stop_profile()

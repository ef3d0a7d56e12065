"""Frozen configuration, built once at start-up. Derived values are properties."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # Llama-3 style, as sorted items
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any] | Any) -> ModelConfig:
        """From a Hugging Face config (dict or PretrainedConfig), v4 and v5 layouts."""
        if not isinstance(cfg, dict):
            cfg = cfg.to_dict()
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = cfg.get("model_type", "llama")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=tuple(sorted(scaling.items())) if rope_type == "llama3" else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, named as SGLang's flags."""

    algorithm: str  # "EAGLE" or "EAGLE3"
    draft_model_path: str
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    # Choose the chain length per iteration (spec/adaptive.py); num_steps is the longest.
    adaptive: bool = False
    adaptive_probe_interval: int = 64
    # A chain drafted step by step on a CPU stops where no request's path probability reaches
    # this (spec/draft_tree.py, chain_goes_on); 0 drafts num_steps every iteration.
    min_path_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.algorithm not in ("EAGLE", "EAGLE3"):
            raise ValueError(
                f"--speculative-algorithm must be EAGLE or EAGLE3, not {self.algorithm}"
            )
        if self.num_steps < 1:
            raise ValueError("--speculative-num-steps must be at least 1")
        if self.eagle_topk < 1:
            raise ValueError("--speculative-eagle-topk must be at least 1")
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                "a chain (--speculative-eagle-topk 1) needs --speculative-num-draft-tokens == "
                f"--speculative-num-steps + 1 = {self.num_steps + 1}, got {self.num_draft_tokens}"
            )
        if not 0.0 <= self.min_path_prob <= 1.0:
            raise ValueError("--speculative-min-path-prob must be in [0, 1]")
        if self.adaptive and self.adaptive_probe_interval < 1:
            raise ValueError("--speculative-adaptive-probe-interval must be at least 1")
        max_nodes = self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        if not (2 <= self.num_draft_tokens <= max_nodes + 1):
            raise ValueError(
                f"--speculative-num-draft-tokens must be in [2, {max_nodes + 1}] for "
                f"topk={self.eagle_topk}, num_steps={self.num_steps}; got {self.num_draft_tokens}"
            )

    @property
    def is_chain(self) -> bool:
        return self.eagle_topk == 1

    @property
    def alloc_len_per_decode(self) -> int:
        """KV slots one request may write in one speculative iteration."""
        return max(self.num_steps * self.eagle_topk, self.num_draft_tokens)

    def decode_slots_per_req(self, overlap: bool) -> int:
        """KV slots a running request holds past its committed length for its next iteration:
        one iteration's alloc_len, twice under the overlap scheduler (it prepares N+1 before it
        knows N's accept lengths, so the host's committed length lags one iteration)."""
        return self.alloc_len_per_decode * (2 if overlap else 1)

    @property
    def max_accept_len(self) -> int:
        """The most tokens one verify commits per request: a path of num_steps drafts (a
        tree's depth, a chain's length at most) and the bonus token."""
        return self.num_steps + 1


# On a CPU a chunk of a few dozen tokens already costs several decode steps, so running streams
# stall in proportion to it; smaller chunks cost the long prompt's first token more
# (bench/prefix_cpu.py --only-chunking). SGLang's GPU default for the GPU.
CPU_PREFILL_CHUNK = 64
GRAPH_MAX_BS = 256  # the default cuda_graph_max_bs's cap
# --speculative-min-path-prob's default, where chains cut there ran faster than whole ones on
# CPUs, with the same tokens (docs/benchmarks.md, "a chain stops where its path is unlikely").
# A name, not a literal: the tests' random heads are never that sure, so the suite drafts
# their whole chains (tests/conftest.py) to keep every depth exercised.
DEFAULT_MIN_PATH_PROB = 0.5
GPU_PREFILL_CHUNK = 8192
# ServerArgs fields renamed to SGLang's flag names: an old name in a flag, a YAML config or an
# Engine argument is an error that names the new one.
RENAMED_FIELDS = {"kv_cache_tokens": "max_total_tokens", "max_context_len": "context_length",
                  "seed": "random_seed"}  # fmt: skip


def renamed_hint(names: Iterable[str]) -> str:
    """' (renamed ...: old -> new, ...)' for the renamed fields among names, else ''."""
    pairs = [f"{n} -> {RENAMED_FIELDS[n]}" for n in sorted(names) if n in RENAMED_FIELDS]
    return f" (renamed to SGLang's names: {', '.join(pairs)})" if pairs else ""


@dataclass(frozen=True)
class ServerArgs:
    """Every CLI flag of `eagleserve serve` maps onto one field here."""

    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # The K/V cache's element type (SGLang's flag name); auto: float16 where the CPU attention
    # kernel reads it (a packed target: half the bytes a long context streams, its arithmetic
    # still fp32; llama.cpp's default cache type too), else the model's dtype.
    kv_cache_dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    load_format: str = "auto"  # auto | dummy (random weights, for benchmarks)
    quantization: str = "auto"  # auto | none | gguf (the GGUF's own 4/8-bit weights, CPU)
    max_running_requests: int = 32
    # Most requests waiting to start (SGLang's flag; scheduler/waiting_queue.py): one more is
    # a 503, or with priority scheduling turns away a lower-priority waiting one. None: no bound.
    max_queued_requests: int | None = None
    max_total_tokens: int = 16384  # the K/V pool's size in tokens (SGLang's flag name)
    # A streamed request's output goes to the server once this many tokens are unsent (its
    # first token and its end at once): fewer, larger chunks, less host work a token (SGLang's
    # and vLLM's flag; scheduler/output_processor.py `output_due`).
    stream_interval: int = 1
    # Most tokens a request may span, prompt + output (SGLang's flag name); default: the
    # model's max_position_embeddings, capped by max_total_tokens.
    context_length: int | None = None
    served_model_name: str | None = None
    # A Jinja chat template in place of the tokenizer's: a file, or the template's text (SGLang's
    # and vLLM's flag; server/chat_template.py).
    chat_template: str | None = None
    # model | openai: an OpenAI request's unset sampling fields from the model's
    # generation_config.json, or OpenAI's defaults (SGLang's flag; server/sampling_defaults.py).
    sampling_defaults: str = "model"
    # A reasoning model's thinking apart from its answer: deepseek-r1 | qwen3 (SGLang's and
    # vLLM's flag; server/reasoning.py).
    reasoning_parser: str | None = None
    # The tool-call format the model writes: hermes (qwen25) | llama3 (llama3_json) | mistral
    # (SGLang's and vLLM's flag and names; server/tool_formats.py).
    tool_call_parser: str = "hermes"
    api_key: str | None = None
    # A log line per request arriving and finishing, with level 0..3 of detail (SGLang's flags;
    # server/request_log.py).
    log_requests: bool = False
    log_requests_level: int = 2
    # Every answer carries the request's X-Request-Id back (a new one where it had none; vLLM's
    # flag; server/middleware.py).
    enable_request_id_headers: bool = False
    # 16 MiB: over 10x the JSON of a 128k-token prompt (~0.5 MB of text, up to 6x for \u
    # escapes), so only abuse or mistakes hit it; tokenizing 16 MB takes ~15 s of a core.
    max_request_body_bytes: int = 16 * 2**20
    # Responses kept in memory for /v1/responses' previous_response_id and GET, the least
    # recently used evicted first (server/response_store.py); 0: `store` is answered false.
    responses_store_size: int = 1000
    # Origins a browser may call the API from (comma-separated; "*": any, as vLLM's and
    # SGLang's servers allow by default; "": none, no CORS headers at all). vLLM's flag name.
    allowed_origins: str = "*"
    # HTTPS: the server's certificate (PEM) and its private key (vLLM's and SGLang's flags).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Seeds the sampling of requests that name no `seed` of their own (SGLang's flag name):
    # with it, the same requests in the same order draw the same tokens from one run to the
    # next; without, each such request draws its seed from the OS's entropy.
    random_seed: int | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int = 3
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 4
    speculative_adaptive: bool = False
    speculative_adaptive_probe_interval: int = 64
    speculative_min_path_prob: float = field(default_factory=lambda: DEFAULT_MIN_PATH_PROB)
    # Time the adaptive controller's cost table now even where a cached one fits (else it is
    # timed only when no table in the cache directory fits: spec/cost_table_cache.py).
    speculative_adaptive_retime: bool = False
    # None: decided by the device (see overlap_schedule); True/False force it off/on.
    disable_overlap_schedule: bool | None = None
    disable_radix_cache: bool = False
    # Most tokens one prefill computes; a longer prompt is prefilled in chunks between decode
    # steps. None: by device (prefill_chunk_size); 0 or less: no chunking.
    chunked_prefill_size: int | None = None
    # CPU: next to decodes, a chunk costs half a decode iteration (scheduler/chunk_budget.py).
    enable_dynamic_chunking: bool = False
    # A prefill chunk joins the running requests' decode in one forward (SGLang's name); not
    # with speculation, whose running requests verify instead of decoding.
    enable_mixed_chunk: bool = False
    # Priority scheduling (SGLang's flags and defaults; scheduler/waiting_queue.py): requests
    # wait in order of their `priority` (higher first, or lower first: vLLM's order), and one that
    # cannot start preempts a running request it outranks by more than the threshold.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    attention_backend: str = "auto"  # auto | torch | triton
    # Batch-invariant kernels (SGLang's name): every verify / extend row is computed bit for bit
    # as the decode of that row, so greedy EAGLE equals target-only on a GPU in bf16 too.
    # On a GPU: the Triton attention backend and Triton GEMMs/RMSNorm (kernels/batch_invariant.py).
    enable_deterministic_inference: bool = False
    disable_cuda_graph: bool = False
    # On an accelerator, generate once alone and once in a batch of 16 before reporting ready,
    # so Triton's first-launch compiles do not stall the first requests (scheduler/warmup.py;
    # SGLang's flag name).
    skip_server_warmup: bool = False
    # GPU: the decoder layers on merged q/k/v and gate/up GEMMs and the fused Triton kernels of
    # kernels/triton_fused.py (models/fused_forward.py); set to run the unfused torch layers.
    # Also the sampled draw's kernel, on a GPU (kernels/triton_sample.py) and on a CPU
    # (kernels/cpu_sample.cpp): set to sample with torch ops.
    disable_fused_kernels: bool = False
    # NVIDIA Hopper and later: launch the Triton kernels with programmatic dependencies, so each
    # one's launch overlaps the tail of the one before (kernels/pdl.py).
    enable_pdl: bool = False
    # Default: graphs cover every running batch (max_running_requests), up to GRAPH_MAX_BS.
    cuda_graph_max_bs: int | None = None
    log_level: str = "info"
    # The engine's throughput and state in a log line every so often (vLLM's flag turns it off;
    # scheduler/stats_log.py).
    disable_log_stats: bool = False
    # Tensor-parallel ranks of one engine (processes; one GPU each on GPUs), and data-parallel
    # replicas, each a whole server on its own port (server/dp.py).
    tp_size: int = 1
    dp_size: int = 1
    # Seconds rank 0 waits at start-up for the other tensor-parallel ranks to join before it
    # fails (a rank that exits before it joins fails it at once); SGLang's flag name.
    dist_timeout: int = 120

    @property
    def spec_config(self) -> SpecConfig | None:
        if not self.speculative_algorithm:
            return None
        if not self.speculative_draft_model_path:
            raise ValueError("--speculative-algorithm needs --speculative-draft-model-path")
        return SpecConfig(
            algorithm=self.speculative_algorithm.upper(),
            draft_model_path=self.speculative_draft_model_path,
            num_steps=self.speculative_num_steps,
            eagle_topk=self.speculative_eagle_topk,
            num_draft_tokens=self.speculative_num_draft_tokens,
            adaptive=self.speculative_adaptive,
            adaptive_probe_interval=self.speculative_adaptive_probe_interval,
            min_path_prob=self.speculative_min_path_prob,
        )

    def max_context_len(self, max_position_embeddings: int, device_type: str) -> int:
        """The most tokens a request may have (prompt and new ones): the model's context (or
        --context-length), capped so that a request that long still finds its next iteration's
        KV slots in the pool, which it holds past its committed length (at most this minus
        one): one per request target-only, a speculative iteration's reserve with EAGLE."""
        spec = self.spec_config
        reserve = spec.decode_slots_per_req(self.overlap_schedule(device_type)) if spec else 1
        if self.max_total_tokens <= reserve:
            raise ValueError(
                f"--max-total-tokens {self.max_total_tokens} leaves no room for a request: a "
                f"running one holds {reserve} KV slots ahead of its tokens with these "
                "speculative settings"
            )
        return min(self.context_length or max_position_embeddings,
                   self.max_total_tokens - reserve + 1)  # fmt: skip

    def overlap_schedule(self, device_type: str) -> bool:
        """Whether the overlap scheduler runs. By default not on a CPU: there the scheduler thread
        competes with the forward's OpenMP threads for the same cores (bench/overlap_cpu.py)."""
        if self.disable_overlap_schedule is None:
            return device_type != "cpu"
        return not self.disable_overlap_schedule

    def graph_max_bs(self) -> int:
        """The largest batch a device graph is captured for: batches above it run eagerly, at
        several times a replay's host cost, so by default graphs cover every batch that can
        run (capped as SGLang caps its own default)."""
        cap = GRAPH_MAX_BS if self.cuda_graph_max_bs is None else self.cuda_graph_max_bs
        return max(1, min(cap, self.max_running_requests))

    def prefill_chunk_size(self, device_type: str) -> int | None:
        """Chunk size of chunked prefill, None when off. On a CPU a forward's cost grows with its
        rows, so a chunk still stalls the streams beside it (dynamic chunking and mixed chunks cut
        that: bench/prefix_cpu.py); on a GPU, SGLang's default."""
        size = self.chunked_prefill_size
        if size is None:
            size = CPU_PREFILL_CHUNK if device_type == "cpu" else GPU_PREFILL_CHUNK
        return size if size > 0 else None

    def dynamic_chunking(self, device_type: str) -> bool:
        """Chunks cut to half a decode iteration's cost while requests decode (asked for; on a
        CPU only, where forwards are synchronous and timed by the host)."""
        return device_type == "cpu" and self.enable_dynamic_chunking

"""The help text of each `eagleserve serve` flag (one per ServerArgs field) and the groups
`--help` shows them in."""

from __future__ import annotations

FIELD_HELP: dict[str, str] = {
    "model": "target model: 'default' (SmolLM2-135M-Instruct), a Hugging Face folder, or a .gguf",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port; the ready line shows which)",
    "device": "auto | cpu | cuda",
    "dtype": "auto | float32 | bfloat16 | float16",
    "kv_cache_dtype": "auto | float32 | float16 | bfloat16: the K/V cache's type (auto: "
    "float16 where the CPU attention kernel reads it, as for a GGUF on CPU; else --dtype's)",
    "load_format": "auto | dummy (random weights, for benchmarks)",
    "quantization": "auto | none | gguf: run a GGUF's Q4_0/Q4_1/Q8_0 weights packed on CPU "
    "(auto: gguf for a GGUF model, e.g. 'default', on CPU when --dtype is auto)",
    "max_running_requests": "most requests decoding at once",
    "max_queued_requests": "most requests waiting to start: one more is answered 503 (with "
    "--enable-priority-scheduling, one that outranks a waiting request that has not started "
    "takes its place, and that one gets the 503; default: no limit)",
    "max_total_tokens": "KV cache size in tokens (all requests together)",
    "context_length": "most tokens per request, prompt + output (default: the model's limit; "
    "at most the KV pool, less a speculative iteration's slots with EAGLE)",
    "served_model_name": "model name the API reports and accepts (default: --model)",
    "sampling_defaults": "model | openai: what a request's unset temperature, top_p, top_k, "
    "min_p, repetition_penalty and (chat) max_tokens mean: the model's generation_config.json "
    "where it sets them, or OpenAI's defaults",
    "reasoning_parser": "deepseek-r1 | qwen3: chat answers carry the thinking (<think>...</think>) "
    "as reasoning_content, apart from content",
    "tool_call_parser": "hermes | qwen25 | llama3 | llama3_json | mistral: the tool-call format "
    "the model was trained to write, which chat tool calls are constrained to and read from",
    "chat_template": "Jinja chat template for the chat routes in place of the tokenizer's: a "
    "file, or the template itself on one line (\\n escapes read as newlines)",
    "log_requests": "log each request as it arrives and as it finishes (logger "
    "eagleserve.requests)",
    "log_requests_level": "with --log-requests: 0 ids, counts, finish reason and latency; 1 and "
    "the sampling parameters set; 2 and the input and output text, 2048 characters of each; 3 "
    "and all of them",
    "api_key": "require 'Authorization: Bearer KEY' on /v1/* (default: $EAGLESERVE_API_KEY)",
    "max_request_body_bytes": "larger request bodies get a 413 before they are read",
    "ssl_certfile": "serve HTTPS with this certificate (PEM; with --ssl-keyfile)",
    "ssl_keyfile": "the certificate's private key (PEM)",
    "allowed_origins": "origins a browser page may call the API from, comma-separated (CORS; "
    "'*': any, as vLLM and SGLang allow; '': none)",
    "responses_store_size": "most /v1/responses answers kept in memory for previous_response_id "
    "and GET /v1/responses/ID, the least recently used dropped first (0: none kept, and no "
    "background responses)",
    "random_seed": "seeds the sampling of requests that name no seed: the same requests in the "
    "same order then draw the same tokens on every run (default: OS entropy per request)",
    "speculative_algorithm": "EAGLE or EAGLE3 to turn on speculative decoding",
    "speculative_draft_model_path": "EAGLE draft head folder",
    "speculative_num_steps": "draft steps per speculative iteration",
    "speculative_eagle_topk": "draft branches per step (1: a chain)",
    "speculative_num_draft_tokens": "tokens verified per iteration (chain: num_steps + 1)",
    "speculative_adaptive": "choose the draft depth per iteration from live acceptance and "
    "measured cost (a chain: 0..num_steps; a tree: all or nothing)",
    "speculative_adaptive_probe_interval": "with --speculative-adaptive: after N iterations "
    "without a draft, draft once at the shallowest depth to keep acceptance figures current "
    "(longer where that costs more than 1%% of the decodes between; doubled after each such "
    "probe that does not pay, up to 8x)",
    "speculative_min_path_prob": "a chain drafted on a CPU stops drafting where no request's "
    "drafts so far have a path probability (the product of the head's probabilities of them) of "
    "at least P: no verify rows for drafts the target would likely reject; 0: always "
    "--speculative-num-steps drafts; a GPU drafts the whole chain in one graph (default: 0.5)",
    "speculative_adaptive_retime": "with --speculative-adaptive: time the cost of each draft "
    "depth at start-up even where a table timed before for this device, model, head, dtype "
    "and thread count is in the cache directory ($EAGLESERVE_CACHE or ~/.cache/eagleserve)",
    "disable_overlap_schedule": (
        "run scheduling and the forward pass one after the other (default: on a CPU only)"
    ),
    "disable_radix_cache": "do not reuse the KV of cached prompt prefixes (radix tree)",
    "chunked_prefill_size": "most tokens one prefill computes: longer prompts are prefilled "
    "in chunks between decode steps (default: 64 on a CPU, 8192 on a GPU; 0 or -1: off)",
    "enable_dynamic_chunking": "on a CPU, while requests decode, cut prefill chunks to half a "
    "decode iteration's measured cost (smoother streams next to a long prompt, slower prefills)",
    "enable_priority_scheduling": "serve waiting requests by their `priority` field (higher "
    "values first), then by arrival; a request that cannot start preempts a running one it "
    "outranks by more than --priority-scheduling-preemption-threshold (without this flag a "
    "request with a priority other than 0 is a 400)",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling: lower `priority` "
    "values first (vLLM's order)",
    "priority_scheduling_preemption_threshold": "with --enable-priority-scheduling: a waiting "
    "request preempts a running one only where its priority is ahead by more than this (the "
    "preempted request waits, then resumes from its cached positions with the same tokens)",
    "enable_mixed_chunk": "run each prefill chunk in the same forward as the running requests' "
    "decode step (not with speculative decoding)",
    "attention_backend": "auto | torch | triton",
    "enable_deterministic_inference": "batch-invariant kernels (GEMM, RMSNorm, attention): a "
    "verify or extend row is computed bit for bit as its decode, so greedy speculative output "
    "equals the target's own on a GPU in bf16 too (Triton attention backend)",
    "disable_cuda_graph": "do not capture CUDA graphs for decode",
    "skip_server_warmup": "on a GPU, report ready without the start-up warm-up generations "
    "(one request alone, then 16 together), which compile the Triton kernels the first "
    "requests would otherwise wait for",
    "disable_fused_kernels": "GPU: run the unfused torch decoder layers (no merged q/k/v and "
    "gate/up GEMMs, no fused norm/activation/rotary Triton kernels) and draw sampled tokens "
    "with torch ops instead of one Triton launch; CPU: sample with torch ops instead of the C++ "
    "sampling kernel",
    "enable_pdl": "NVIDIA GPUs of compute capability 9.0 and later (H100, H200): launch the "
    "Triton kernels with programmatic dependent launch, so each kernel's launch overlaps the "
    "end of the one before it",
    "cuda_graph_max_bs": "largest batch size captured in a CUDA graph (default: "
    "--max-running-requests, at most 256)",
    "log_level": "debug | info | warning | error",
    "enable_request_id_headers": "every answer carries the request's X-Request-Id header back, a "
    "new id where it sent none (which then names its completion, as a sent one does; vLLM's "
    "flag)",
    "stream_interval": "tokens a streamed request's output gathers before the engine sends it "
    "(its first token and its end go at once): a larger value streams fewer, larger chunks for "
    "less host work a token, which pays where the server shares the engine's CPU cores "
    "(SGLang's and vLLM's flag; a request that is not streamed sends every 50 tokens, or "
    "after a second)",
    "disable_log_stats": "no periodic log line of the engine's throughput, requests, KV use, "
    "prefix cache hits and speculative acceptance (every $EAGLESERVE_LOG_STATS_INTERVAL "
    "seconds, 10, while it has work; vLLM's flag)",
    "tp_size": "tensor parallelism: ranks (processes, one GPU each) that split the target's "
    "heads, MLP and vocabulary (gloo on CPU, NCCL/RCCL on GPUs)",
    "dist_timeout": "seconds the engine waits at start-up for its other tensor-parallel ranks "
    "to join before it fails (a rank that exits first fails it at once)",
    "dp_size": "data parallelism: replicas, each a whole server on --port + i (put nginx in "
    "front: deploy/nginx.conf)",
}


# --help shows the flags in these groups, in this order (every ServerArgs field in one).
FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "kv_cache_dtype", "load_format", "quantization", "context_length",
              "served_model_name", "chat_template", "sampling_defaults", "reasoning_parser",
              "tool_call_parser"),
    "server": ("host", "port", "api_key", "allowed_origins", "ssl_certfile", "ssl_keyfile",
               "max_request_body_bytes", "responses_store_size", "log_level", "log_requests",
               "log_requests_level", "disable_log_stats", "enable_request_id_headers"),
    "scheduler": ("max_running_requests", "max_queued_requests", "max_total_tokens", "random_seed",
                  "stream_interval",
                  "disable_overlap_schedule", "disable_radix_cache", "chunked_prefill_size",
                  "enable_dynamic_chunking", "enable_mixed_chunk",
                  "enable_priority_scheduling", "schedule_low_priority_values_first",
                  "priority_scheduling_preemption_threshold"),
    "speculative decoding": ("speculative_algorithm", "speculative_draft_model_path",
                             "speculative_num_steps", "speculative_eagle_topk",
                             "speculative_num_draft_tokens", "speculative_adaptive",
                             "speculative_adaptive_probe_interval",
                             "speculative_adaptive_retime", "speculative_min_path_prob"),
    "GPU": ("device", "attention_backend", "enable_deterministic_inference",
            "disable_cuda_graph", "disable_fused_kernels", "enable_pdl", "cuda_graph_max_bs",
            "skip_server_warmup"),
    "scaling out": ("tp_size", "dp_size", "dist_timeout"),
}  # fmt: skip


# vLLM's flags that users bring from vLLM deployments, and what eagleserve takes instead (given
# one, `serve` stops with that, in one line).
VLLM_FLAGS: dict[str, str] = {
    "--max-model-len": "eagleserve's is --context-length",
    "--max-num-seqs": "eagleserve's is --max-running-requests",
    "--tensor-parallel-size": "eagleserve's is --tp-size",
    "-tp": "eagleserve's is --tp-size",
    "--data-parallel-size": "eagleserve's is --dp-size",
    "-dp": "eagleserve's is --dp-size",
    "--enforce-eager": "eagleserve's is --disable-cuda-graph",
    "--gpu-memory-utilization": "eagleserve sizes the KV pool in tokens: --max-total-tokens",
    "--speculative-config": "eagleserve's are --speculative-algorithm, "
    "--speculative-draft-model-path and --speculative-num-steps",
    "--no-enable-prefix-caching": "eagleserve's is --disable-radix-cache",
    "--enable-prefix-caching": "prefix caching is on by default (--disable-radix-cache turns it "
    "off): drop it",
    "--enable-auto-tool-choice": "tool_choice auto is always served (--tool-call-parser sets "
    "the format): drop it",
    "--trust-remote-code": "eagleserve runs no code from a model's folder: drop it",
}

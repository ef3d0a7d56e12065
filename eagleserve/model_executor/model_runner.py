"""ModelRunner: the target model, its KV pools and attention backend, and one-forward calls."""

from __future__ import annotations

import logging
import time

import torch

from eagleserve.config import ModelConfig, ServerArgs
from eagleserve.core import ForwardMode, ScheduleBatch
from eagleserve.distributed.parallel import get_tp
from eagleserve.kernels import cpu_ext, pdl
from eagleserve.layers.attention import create_attn_backend
from eagleserve.layers.forward_batch import ForwardBatch, forward_context
from eagleserve.mem_cache.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.model_executor.cuda_graph_runner import (
    ExtraShapes,
    GraphedForward,
    GraphEpilogue,
    graphs_supported,
)
from eagleserve.model_executor.prefill_graphs import PrefillGraphs
from eagleserve.models.llama import LlamaForCausalLM, ModelOutput
from eagleserve.models.loader import load_weights
from eagleserve.models.tp_shard import TpShard
from eagleserve.sampling.penalty_state import PenaltyState
from eagleserve.sampling.sampling_info import DrawKernel, SamplingInfo

logger = logging.getLogger(__name__)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    dtype = dtype.lower()  # the CLI's check takes any case
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device, row_kernel: bool
) -> torch.dtype:
    """The K/V pool's dtype. row_kernel: the CPU attention kernel (kernels/cpu_attention.cpp)
    reads the pool, in fp32 arithmetic from fp32 or fp16 K/V; auto gives it fp16 (the bytes a
    long context streams halved; prefill, decode and verify store the same rounded bits, so
    speculation stays lossless). Elsewhere the pool keeps the model's dtype."""
    kv_cache_dtype = kv_cache_dtype.lower()
    if kv_cache_dtype == "auto":
        return torch.float16 if row_kernel else model_dtype
    if kv_cache_dtype not in DTYPES:
        raise ValueError(
            f"unknown --kv-cache-dtype {kv_cache_dtype!r}: auto, float32, float16 or bfloat16"
        )
    dtype = DTYPES[kv_cache_dtype]
    if row_kernel and dtype not in (torch.float32, torch.float16):
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype}: the CPU attention kernel reads float32 or "
            "float16 K/V (or leave it auto)"
        )
    if device.type != "cpu" and dtype != model_dtype:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype}: on a GPU the K/V cache is in the model's "
            f"dtype ({str(model_dtype).removeprefix('torch.')}; leave it auto)"
        )
    return dtype


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights (N(0, 0.02), norms 1), deterministic in `seed`, made on the model's device:
    for benchmarks of model shapes whose weights are not at hand (vLLM's --load-format dummy)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def use_fused_kernels(
    device: torch.device, attention_backend: str, gguf_path: str | None, shard: object
) -> bool:
    """The fused Triton layers (models/fused_forward.py) run on a GPU with Triton attention and
    plain (unpacked, unsharded) weights: the CPU keeps its own kernels, packed GGUF linears keep
    their fused layout, and a tensor-parallel layer reduces between its GEMMs."""
    name = (
        attention_backend
        if attention_backend != "auto"
        else ("torch" if device.type == "cpu" else "triton")
    )
    return device.type != "cpu" and name == "triton" and gguf_path is None and shard is None


def draw_kernel(device: torch.device) -> DrawKernel | None:
    """Where this device's sampled rows draw (sampler.py `SamplingInfo.draw_kernel`): one Triton
    launch on an accelerator; on a CPU one C++ call, where the extension loads (the packed
    target's; built once)."""
    if device.type != "cpu":
        return "triton"
    return "cpu" if cpu_ext.load() else None


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model_path: str | None,
        device: torch.device,
        dtype: torch.dtype,
        max_total_tokens: int,
        max_running_requests: int,
        max_context_len: int,
        attention_backend: str = "auto",
        aux_layer_ids: tuple[int, ...] = (),
        load_format: str = "auto",
        gguf_path: str | None = None,
        deterministic: bool = False,
        fused_kernels: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.gguf_path = gguf_path  # set: linears run packed from this GGUF (models/quant.py)
        self.max_context_len = max_context_len
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, max_context_len, aux_layer_ids)
        tp = get_tp()
        # Under tensor parallelism this process holds one rank's slice (models/tp_shard.py).
        self.tp_shard = (
            TpShard.plan(model_config, tp.rank, tp.size, gguf_path is not None)
            if tp.enabled
            else None
        )
        if self.tp_shard is not None:
            self.tp_shard.shard_meta(model)
        shard = self.tp_shard
        # Real parameters in the target dtype; rotary caches stay fp32 as in transformers.
        model = model.to(dtype).to_empty(device=device)
        model.model.rotary_emb.build(device)
        if load_format == "dummy":
            init_dummy_weights(model)
        elif model_path is not None:
            # Linears whose GGUF tensors are Q4_0/Q4_1/Q8_0 run packed (models/quant.py),
            # packed once and kept in the cache directory (models/weight_cache.py): on a
            # hit, the fp weights they replace are not read.
            packed = None
            if gguf_path is not None:
                from eagleserve.models.weight_cache import find_packed

                packed = find_packed(model, gguf_path, model_path,
                                     shard_id=(tp.rank, tp.size) if shard else (0, 1))  # fmt: skip
            load_weights(model, model_path, desc="target weights",
                         transform=shard.slice_tensor if shard else None,
                         skip=packed.replaced_weights() if packed else ())  # fmt: skip
            if packed is not None and gguf_path is not None:
                packed.install(model, gguf_path, shard=shard.slice_quant if shard else None)
        if shard is not None:
            shard.gather_logits(model)
        self.draw_kernel: DrawKernel | None = draw_kernel(device) if fused_kernels else None
        if fused_kernels and use_fused_kernels(device, attention_backend, gguf_path, shard):
            from eagleserve.models.fused_forward import enable_fused_kernels

            enable_fused_kernels(model, device)
        self.model = model.eval()
        t1 = time.perf_counter()
        logger.info("start-up: target model loaded in %.2f s", t1 - t0)
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, max_context_len, device)
        # Penalty counts per request slot (allocated at the first request with penalties).
        self.penalty_state = PenaltyState(max_running_requests, model_config.vocab_size, device)
        self.attn_backend = create_attn_backend(
            attention_backend,
            device,
            self.req_to_token_pool.req_to_token,
            model_config.head_dim**-0.5,
            shape_invariant=gguf_path is not None,
            deterministic=deterministic,
        )
        self.token_to_kv_pool = TokenToKVPool(
            max_total_tokens,
            model_config.num_hidden_layers,
            len(shard.kv_heads) if shard else model_config.num_key_value_heads,
            model_config.head_dim,
            resolve_kv_cache_dtype(
                kv_cache_dtype, dtype, device, getattr(self.attn_backend, "row_kernel", False)
            ),
            device,
        )
        # Batch-invariant linears and norms where the attention is too (Triton); a CPU torch
        # backend is row-invariant through its own kernels.
        self.batch_invariant = bool(getattr(self.attn_backend, "deterministic", False))
        if self.batch_invariant:
            from eagleserve.models.batch_invariant import make_batch_invariant

            make_batch_invariant(self.model)

        logger.info("start-up: KV pool of %d tokens in %.2f s", max_total_tokens,
                    time.perf_counter() - t1)  # fmt: skip
        self.graphs: list[GraphedForward] = []
        self.prefill_graphs: PrefillGraphs | None = None

    @classmethod
    def from_args(
        cls,
        args: ServerArgs,
        model_config: ModelConfig,
        model_path: str,
        device: torch.device,
        max_context_len: int,
    ) -> ModelRunner:
        """The served target as `args` ask for it (dtype, pools, backend, packed GGUF weights);
        the Triton kernels' launches with programmatic dependencies where asked for."""
        from eagleserve.models.loader import packed_gguf_path

        pdl.configure(args.enable_pdl, device)

        return cls(
            model_config,
            model_path,
            device,
            resolve_dtype(args.dtype, device),
            args.max_total_tokens,
            args.max_running_requests,
            max_context_len,
            args.attention_backend,
            load_format=args.load_format,
            gguf_path=packed_gguf_path(args.quantization, args.model, args.dtype, device),
            deterministic=args.enable_deterministic_inference,
            fused_kernels=not args.disable_fused_kernels,
            kv_cache_dtype=args.kv_cache_dtype,
        )

    def graphs_enabled(self, args: ServerArgs) -> bool:
        return graphs_supported(self.device, args.disable_cuda_graph, self.attn_backend)

    def capture_graphs(
        self,
        max_bs: int,
        verify_tokens: tuple[int, ...],
        tree: bool,
        verify_epilogue: GraphEpilogue | None = None,
        verify_extras: ExtraShapes | None = None,
    ) -> None:
        """Device graphs for decode, for verify with each of `verify_tokens` per request, and
        for a single request's prefill (prefill_graphs.py). `verify_epilogue(fb, extras,
        logits)`: tensors each verify graph also computes after its forward (the acceptance
        walks), in the replay's ModelOutput.epilogue, from the static `verify_extras` a
        forward may fill (`forward`'s `extras`)."""
        t0 = time.perf_counter()
        kinds: list[tuple[ForwardMode, int, bool]] = [("decode", 1, False)]
        kinds += [("verify", n, tree) for n in verify_tokens]
        for mode, n, with_tree in kinds:
            epilogue = verify_epilogue if mode == "verify" else None
            graph = GraphedForward(
                lambda fb, extras, epilogue=epilogue: self._graph_outputs(fb, epilogue, extras),
                mode,
                self.token_to_kv_pool,
                self.attn_backend,
                self.device,
                max_bs,
                n,
                tree=with_tree,
                extra_shapes=verify_extras if mode == "verify" else None,
            )
            graph.capture()
            self.graphs.append(graph)
        prefill = PrefillGraphs(lambda fb, extras: self._graph_outputs(fb, None, extras),
                                self.token_to_kv_pool, self.attn_backend, self.device)  # fmt: skip
        try:
            prefill.capture()
            self.prefill_graphs = prefill
        except Exception:  # prefills still run, eagerly; tests/spec/test_gpu_paths.py
            logger.exception("capturing the prefill graphs failed: prefilling eagerly")
        logger.info("start-up: %d target graphs captured in %.2f s",
                    len(self.graphs) + len(getattr(self.prefill_graphs, "graphs", ())),
                    time.perf_counter() - t0)  # fmt: skip

    def _graph_outputs(
        self, fb: ForwardBatch, epilogue: GraphEpilogue | None, extras: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """(logits, hidden, [aux hidden: EAGLE3 targets], *epilogue)."""
        out = self.model()
        aux = () if out.aux_hidden_states is None else (out.aux_hidden_states,)
        more = () if epilogue is None else epilogue(fb, extras, out.logits)
        return (out.logits, out.hidden_states, *aux, *more)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, **extras: torch.Tensor) -> ModelOutput:
        """One target forward: a captured graph when one computes `fb` (`extras` into its
        static extras, for its epilogue), else eager (no epilogue)."""
        n = None if self.prefill_graphs is None else self.prefill_graphs.bucket(fb)
        if n is not None:
            assert self.prefill_graphs is not None
            logits, hidden, *rest = self.prefill_graphs.replay(fb, n)
            new = fb.host.max_extend  # the eager forward's rows: logits of its last token only
            aux = rest[0][:new] if self.model.aux_layer_ids else None
            return ModelOutput(logits[new - 1 : new], hidden[:new], aux, graph_buffers=True)
        for graph in self.graphs:
            if graph.can_replay(fb):
                logits, hidden, *rest = graph.replay(fb, **extras)
                aux = rest.pop(0) if self.model.aux_layer_ids else None
                return ModelOutput(logits, hidden, aux, graph_buffers=True, epilogue=tuple(rest))
        with forward_context(fb):
            return self.model()

    def forward_batch(self, batch: ScheduleBatch) -> ModelOutput:
        """The target forward of a scheduled prefill or decode batch."""
        return self.forward(ForwardBatch.init_new(batch, self.token_to_kv_pool, self.attn_backend))

    def sampling_info(self, batch: ScheduleBatch) -> SamplingInfo:
        """The batch's sampling info (made once per membership), drawing on this runner's
        kernel."""
        return SamplingInfo.of_batch(batch, self.config.vocab_size, self.draw_kernel)

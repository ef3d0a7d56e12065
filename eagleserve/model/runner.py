"""ModelRunner: the target model, its KV pools and attention backend, and one-forward calls."""

from __future__ import annotations

import torch

from eagleserve.config import ModelConfig
from eagleserve.core import ForwardMode
from eagleserve.model.attention import create_attn_backend
from eagleserve.model.cuda_graph import GraphedForward
from eagleserve.model.forward_batch import ForwardBatch, forward_context
from eagleserve.model.kv_cache import ReqToTokenPool, TokenToKVPool
from eagleserve.model.llama import LlamaForCausalLM, ModelOutput
from eagleserve.model.loader import load_weights


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}: auto, float32, bfloat16 or float16")
    return table[dtype]


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


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model_path: str | None,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_tokens: int,
        max_running_requests: int,
        max_context_len: int,
        attention_backend: str = "auto",
        aux_layer_ids: tuple[int, ...] = (),
        load_format: str = "auto",
        gguf_path: str | None = None,
    ) -> None:
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.max_context_len = max_context_len
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, max_context_len, aux_layer_ids)
        # Real parameters in the target dtype; rotary caches stay fp32 as in transformers.
        model = model.to(dtype).to_empty(device=device)
        model.model.rotary_emb.build(device)
        if load_format == "dummy":
            init_dummy_weights(model)
        elif model_path is not None:
            load_weights(model, model_path, desc="target weights")
            if gguf_path is not None:
                # Linears whose GGUF tensors are Q4_0/Q4_1/Q8_0 run packed (model/quant.py).
                from eagleserve.model.quant import quantize_model_from_gguf

                quantize_model_from_gguf(model, gguf_path)
        self.model = model.eval()
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, max_context_len, device)
        self.token_to_kv_pool = TokenToKVPool(
            kv_cache_tokens,
            model_config.num_hidden_layers,
            model_config.num_key_value_heads,
            model_config.head_dim,
            dtype,
            device,
        )
        self.attn_backend = create_attn_backend(
            attention_backend,
            device,
            self.req_to_token_pool.req_to_token,
            model_config.head_dim**-0.5,
            shape_invariant=gguf_path is not None,
        )

        self.graphs: dict[tuple[str, int], GraphedForward] = {}

    def capture_graphs(self, max_bs: int, verify_tokens: int | None, tree: bool) -> None:
        """Device graphs for decode (and verify with `verify_tokens` per request)."""
        kinds = [("decode", 1, False)]
        if verify_tokens is not None:
            kinds.append(("verify", verify_tokens, tree))
        for mode, n, with_tree in kinds:
            graph = GraphedForward(
                lambda fb, extras: self._graph_outputs(self.model()),
                lambda _mode=mode, **kw: ForwardBatch(
                    mode=_mode,
                    kv_pool=self.token_to_kv_pool,
                    attn_backend=self.attn_backend,
                    **kw,
                ),
                self.device,
                max_bs,
                n,
                tree=with_tree,
            )
            graph.capture()
            self.graphs[(mode, n)] = graph

    def _graph_outputs(self, out: ModelOutput) -> tuple[torch.Tensor, ...]:
        aux = () if out.aux_hidden_states is None else (out.aux_hidden_states,)
        return (out.logits, out.hidden_states, *aux)

    @torch.inference_mode()
    def forward(
        self,
        mode: ForwardMode,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
    ) -> ModelOutput:
        bs = req_pool_indices.shape[0]
        graph = self.graphs.get((mode, input_ids.shape[0] // max(bs, 1)))
        if graph is not None and graph.can_run(bs) and logits_indices is None and kv_lens is None:
            logits, hidden, *aux = graph.replay(
                input_ids, positions, out_cache_loc, req_pool_indices, prefix_lens, tree_mask
            )
            return ModelOutput(logits, hidden, aux[0] if aux else None)
        fb = ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            logits_indices=logits_indices,
            tree_mask=tree_mask,
            kv_lens=kv_lens,
        )
        with forward_context(fb):
            return self.model()

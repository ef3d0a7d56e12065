"""The frozen target that teacher-forced extraction and training read, the layers whose
features an EAGLE head takes, and the fresh head trained on them. Its own module so tf_cli
(extraction), tf_train, cli and the recipe (training) use it without importing each other."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

from eagleserve.spec.eagle_head import EagleHead
from eagleserve.spec.head_loader import eagle3_aux_layer_ids
from eagleserve.train.features import feature_layers

if TYPE_CHECKING:
    from eagleserve.models.llama import LlamaForCausalLM


def load_target(
    model: str, extract_dtype: str, max_len: int, device: str = "cpu"
) -> tuple[object, object]:
    """(target LlamaForCausalLM, tokenizer), frozen, in the form extraction runs it, on
    `device`; its rotary tables cover `max_len` positions (they are sized by the KV pool)."""
    from eagleserve import Engine

    kw = {} if extract_dtype == "served" else {"dtype": extract_dtype}
    if device != "cpu":
        kw["disable_cuda_graph"] = True  # only the dense training forward runs
    eng = Engine(model=model, device=device, disable_overlap_schedule=True,
                 max_running_requests=1, max_total_tokens=max_len + 16, **kw)  # fmt: skip
    target = eng.scheduler.worker.runner.model
    for p in target.parameters():
        p.requires_grad_(False)
    return target, eng.tokenizer


def target_layer_ids(algorithm: str, n_layers: int) -> tuple[int, ...]:
    aux = tuple(eagle3_aux_layer_ids({}, n_layers)) if algorithm == "EAGLE3" else ()
    return feature_layers(algorithm, aux, n_layers)


def fresh_head(
    ns: argparse.Namespace,
    algorithm: str,
    target: LlamaForCausalLM,
    draft_ids: torch.Tensor | None,
) -> EagleHead:
    """The head a train-draft run starts from: seeded, its MLP --draft-intermediate-size wide,
    --draft-num-hidden-layers deep."""
    from eagleserve.spec.head_loader import init_eagle_head

    if ns.draft_num_hidden_layers != 1 and algorithm != "EAGLE3":
        raise SystemExit(f"--draft-num-hidden-layers {ns.draft_num_hidden_layers}: EAGLE heads "
                         "have one layer (EAGLE3 heads may have more)")  # fmt: skip
    return init_eagle_head(algorithm, target, seed=ns.seed, draft_token_ids=draft_ids,
                           intermediate_size=ns.draft_intermediate_size,
                           num_hidden_layers=ns.draft_num_hidden_layers)  # fmt: skip

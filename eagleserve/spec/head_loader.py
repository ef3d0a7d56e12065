"""Loading, saving and randomly initializing EAGLE/EAGLE3 heads in the published formats.

Format facts relied on:
- EAGLE-1/2 config (`LlamaForCausalLMEagle`, or the reference repo's one-layer
  `LlamaForCausalLM`): a missing `bias` key means fc has a bias (Vicuna/LLaMA-2 heads).
- Names may carry a `model.` prefix; `embed_tokens.weight` is optional (the target's is used),
  old .bin files may hold `rotary_emb.inv_freq` buffers; EAGLE3 `t2d` is optional and unused.
- EAGLE3 `d2t` [draft_vocab] int64 maps draft id i to target id i + d2t[i]; it may be absent
  only when the draft vocab is the full target vocab.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from eagleserve.config import ModelConfig
from eagleserve.models.llama import LlamaForCausalLM
from eagleserve.models.loader import iter_checkpoint, load_config_dict
from eagleserve.spec.eagle_head import ALGORITHMS, EagleHead, build_head

ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}


def head_model_config(raw: dict[str, Any], target_cfg: ModelConfig) -> ModelConfig:
    """The head's ModelConfig from its config.json; checks it fits the target."""
    d = dict(raw)
    d.setdefault("num_hidden_layers", 1)
    d.setdefault("vocab_size", target_cfg.vocab_size)
    try:
        cfg = ModelConfig.from_hf(d)
    except KeyError as e:
        raise KeyError(f"draft head config.json lacks {e.args[0]!r}") from None
    if cfg.num_hidden_layers < 1:
        raise ValueError(f"draft head num_hidden_layers {cfg.num_hidden_layers}: at least 1")
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"draft head hidden_size {cfg.hidden_size} != target hidden_size "
            f"{target_cfg.hidden_size}: the head was trained for another target"
        )
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"draft head vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}"
        )
    # Heads have no q/k/v bias unless the config says so (from_hf guesses it from model_type).
    return dataclasses.replace(
        cfg, attention_bias=bool(raw.get("attention_bias", False)), tie_word_embeddings=False
    )


def eagle3_aux_layer_ids(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose *entering* hidden state EAGLE3 fuses, in the target's layer order.

    `eagle_aux_hidden_state_layer_ids` name layers whose *output* is taken, hence the +1; the
    default {2, N//2, N-3} is the reference's choice of entering states.
    """
    n = num_target_layers
    given = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [i + 1 for i in given] if given is not None else [2, n // 2, n - 3]
    if len(set(ids)) != len(ids) or not all(0 <= i < n for i in ids):
        raise ValueError(
            f"EAGLE3 aux layers {ids} (entering-layer ids) must be distinct and in [0, {n}) for a "
            f"{n}-layer target; set eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    return tuple(sorted(ids))


def _check_algorithm(algorithm: str) -> str:
    algorithm = algorithm.upper()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown draft algorithm {algorithm!r}: EAGLE or EAGLE3")
    return algorithm


def load_eagle_head(
    path: str, algorithm: str, target: LlamaForCausalLM, device: torch.device, dtype: torch.dtype
) -> EagleHead:
    algorithm = _check_algorithm(algorithm)
    raw = load_config_dict(path)
    archs = raw.get("architectures") or []
    if algorithm == "EAGLE" and any("Eagle3" in a for a in archs):
        raise ValueError(f"{path} is an EAGLE3 head ({archs}); use --speculative-algorithm EAGLE3")
    cfg = head_model_config(raw, target.config)
    target_vocab = target.config.vocab_size
    if algorithm == "EAGLE":
        if cfg.num_hidden_layers != 1:
            raise ValueError(f"{path}: EAGLE heads with {cfg.num_hidden_layers} layers unsupported")
        kwargs: dict = {"fc_bias": bool(raw.get("bias", True))}
    else:
        draft_vocab = int(raw.get("draft_vocab_size") or target_vocab)
        if not 0 < draft_vocab <= target_vocab:
            raise ValueError(f"{path}: draft_vocab_size {draft_vocab} not in [1, {target_vocab}]")
        aux = eagle3_aux_layer_ids(raw, target.config.num_hidden_layers)
        kwargs = {"aux_layer_ids": aux, "draft_vocab_size": draft_vocab}
    head = build_head(algorithm, cfg, target, device, dtype, **kwargs)

    expected = head.state_dict()  # name -> tensor sharing storage with the parameter/buffer
    optional_shapes = {"embed_tokens.weight": tuple(target.model.embed_tokens.weight.shape)}
    if algorithm == "EAGLE3":
        optional_shapes["t2d"] = (target_vocab,)
    seen: set[str] = set()
    for name, tensor in iter_checkpoint(path):
        name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if name in optional_shapes:
            want = optional_shapes[name]
        elif name in expected:
            want = tuple(expected[name].shape)
        else:
            raise KeyError(f"unexpected tensor {name!r} in {algorithm} head {path}")
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, expected {want}"
            )
        if name in optional_shapes:
            continue  # shape-checked; the target's embedding is used, t2d is derivable
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in {path}")
        with torch.no_grad():
            expected[name].copy_(tensor.to(expected[name].dtype))
        seen.add(name)

    missing = set(expected) - seen
    if algorithm == "EAGLE3" and head.draft_vocab_size == target_vocab:
        missing.discard("d2t")  # full draft vocab: the identity map (zeros) is right
    if "fc.bias" in missing:
        why = "has no 'bias' key (means true)" if "bias" not in raw else "sets bias: true"
        raise KeyError(f"tensor 'fc.bias' missing from {path}: its config.json {why}")
    if missing:
        raise KeyError(f"tensors missing from {algorithm} head {path}: {sorted(missing)}")
    if algorithm == "EAGLE3":
        ids = head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device))
        if bool(((ids < 0) | (ids >= target_vocab)).any()):
            raise ValueError(f"'d2t' in {path} maps draft ids outside the target vocab")
    return head.eval()


def measured_acceptance(path: str) -> list[float] | None:
    """The head's held-out accuracy by depth from the `training_log.json` that `eagleserve
    train-draft` writes beside it, or None when there is none: over every answer row
    (acc0_all, ...: a target token outside the draft vocabulary is a rejected draft) where the
    log has it, else over the rows the head can draft (acc0, ...)."""
    log_path = os.path.join(path, "training_log.json")
    if not os.path.isfile(log_path):
        return None
    with open(log_path) as f:
        by_depth = json.load(f).get("val_accuracy_by_depth") or {}
    suffix = "_all" if "acc0_all" in by_depth else ""
    values: list[float] = []
    while f"acc{len(values)}{suffix}" in by_depth:
        values.append(float(by_depth[f"acc{len(values)}{suffix}"]))
    return values or None


def shard_names(sizes: list[int], max_bytes: int) -> list[int]:
    """Shard number of each tensor (sizes in bytes, in order): consecutive tensors share a shard
    while it stays within `max_bytes` (a tensor larger than that gets a shard of its own)."""
    out, shard, used = [], 0, 0
    for n in sizes:
        if used and used + n > max_bytes:
            shard, used = shard + 1, 0
        out.append(shard)
        used += n
    return out


def _write_safetensors(state: dict[str, torch.Tensor], out_dir: str, max_bytes: int | None) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + the HF index when the tensors
    exceed `max_bytes` (every loader here reads all *.safetensors of a folder as one); files of
    an earlier save are removed first, so no tensor is found twice."""
    for old in glob.glob(os.path.join(out_dir, "model*.safetensors*")):
        os.remove(old)
    names = list(state)
    sizes = [state[k].numel() * state[k].element_size() for k in names]
    if max_bytes is None or sum(sizes) <= max_bytes:
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    shard_of = shard_names(sizes, max_bytes)
    n = shard_of[-1] + 1
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, f in enumerate(files):
        part = {k: state[k] for k, sh in zip(names, shard_of) if sh == i}
        save_file(part, os.path.join(out_dir, f), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(sizes)},
             "weight_map": {k: files[sh] for k, sh in zip(names, shard_of)}}  # fmt: skip
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)


def save_eagle_head(head: EagleHead, out_dir: str, max_shard_bytes: int | None = None) -> None:
    """Writes config.json + model.safetensors in the published format of `head.algorithm`,
    split into shards of at most `max_shard_bytes` each where given."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = head.config
    raw: dict = {
        "architectures": [ARCHITECTURES[head.algorithm]],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": head.target_vocab_size,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": False,
        "torch_dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
    }
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    if head.algorithm == "EAGLE":
        raw["bias"] = head.fc_bias  # explicit: a missing key would mean true
    else:
        raw["draft_vocab_size"] = head.draft_vocab_size
        # Stored as "output of layer i" ids, the published convention (entering id - 1).
        aux = [i - 1 for i in head.aux_layer_ids]
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        draft_ids = torch.arange(head.draft_vocab_size, device=head.d2t.device)
        t2d = torch.zeros(head.target_vocab_size, dtype=torch.bool)  # [target_vocab]
        t2d[head.to_target_ids(draft_ids).cpu()] = True
        state["t2d"] = t2d
    _write_safetensors(state, out_dir, max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)


def init_eagle_head(
    algorithm: str,
    target: LlamaForCausalLM,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    draft_token_ids: torch.Tensor | None = None,
    intermediate_size: int | None = None,
    num_hidden_layers: int = 1,
) -> EagleHead:
    """A fresh head for `target`, on the target's device and dtype, deterministic in `seed`;
    its MLPs `intermediate_size` wide (default: the target's); EAGLE3 may have
    `num_hidden_layers` > 1 (the midlayer, then plain decoder layers).

    Linear weights ~ N(0, 0.02), biases 0, norms 1. EAGLE gets an fc bias (the reference
    default). EAGLE3's lm_head starts as the target's lm_head rows of the draft vocab, whose
    target ids are `draft_token_ids` (sorted; default: the first `draft_vocab_size` ids).
    """
    algorithm = _check_algorithm(algorithm)
    tcfg = target.config
    # Token ids are a tokenizer matter: the head config carries none, as a loaded head's.
    cfg = dataclasses.replace(
        tcfg,
        num_hidden_layers=num_hidden_layers,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_ids=(),
        bos_token_id=None,
        intermediate_size=intermediate_size or tcfg.intermediate_size,
    )
    ref = target.model.embed_tokens.weight
    kwargs: dict = {"fc_bias": True}
    ids = None
    if algorithm == "EAGLE3":
        if draft_token_ids is not None:
            ids = torch.unique(draft_token_ids.to("cpu", torch.int64))  # sorted, distinct
            if draft_vocab_size is not None and draft_vocab_size != ids.numel():
                raise ValueError("draft_vocab_size disagrees with len(unique(draft_token_ids))")
        else:
            ids = torch.arange(draft_vocab_size or tcfg.vocab_size)
        if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= tcfg.vocab_size:
            raise ValueError(f"draft token ids must be in [0, {tcfg.vocab_size})")
        kwargs = {
            "aux_layer_ids": eagle3_aux_layer_ids({}, tcfg.num_hidden_layers),
            "draft_vocab_size": ids.numel(),
        }
    head = build_head(algorithm, cfg, target, ref.device, ref.dtype, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        if ids is not None:
            head.lm_head.weight.copy_(target.lm_head_weight[ids.to(ref.device)])
            head.d2t.copy_(ids - torch.arange(ids.numel()))
    return head.eval()

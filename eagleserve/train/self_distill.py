"""Self-distillation data: the target's own answers to the held-in ShareGPT prompts.

The first user turn of every training conversation (the caller passes only held-in
conversations; MT-bench / HumanEval leaks are dropped here too) is rendered with the chat
template exactly as the server renders a chat request, and the engine answers it in large
continuous batches on the training device. The item trained on is the served token stream
itself: prompt ids + the generated ids (never re-tokenized text, which may split differently),
answer flags on the generated ids. A head trained on the target's own tokens learns the
distribution it will be verified against.

Generated answers are cached in `<cache>/self_distill/<key>.json`, the key a hash of the model,
the generation settings and the prompt ids, so a second run with the same settings reuses them.

CLI flags map one-to-one onto `SelfDistillConfig`: `--self-distill` onto `mode`, and
`--self-distill-<field>` (dashes) onto each other field; the seed is `--seed`.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Literal

from tqdm import tqdm

from eagleserve.sampling_params import SEED_BOUND, SamplingParams
from eagleserve.train.conversations import leaks
from eagleserve.train.extract import Item

Mode = Literal["off", "replace", "add"]


@dataclass(frozen=True)
class SelfDistillConfig:
    mode: Mode = "off"  # replace: train on the generated answers only; add: beside ShareGPT's
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy; > 0: sampled with a per-prompt seed
    max_prompts: int | None = None  # None: every held-in conversation's first user turn
    max_prompt_tokens: int = 512  # longer templated prompts are skipped
    batch_size: int = 256  # requests the engine runs at once
    cache_dir: str | None = None  # None: <EAGLESERVE_CACHE>/self_distill
    seed: int = 0


def add_self_distill_args(p: argparse.ArgumentParser) -> None:
    d = SelfDistillConfig()
    g = p.add_argument_group("self-distillation (--recipe gpu)")
    g.add_argument("--self-distill", default=d.mode, choices=["off", "replace", "add"],
                   help="train on the target's own answers to the held-in ShareGPT prompts: "
                   "instead of (replace) or beside (add) the human answers")  # fmt: skip
    g.add_argument("--self-distill-max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--self-distill-temperature", type=float, default=d.temperature,
                   help="0: greedy; > 0: sampled, seeded by --seed + prompt index")  # fmt: skip
    g.add_argument("--self-distill-max-prompts", type=int, default=d.max_prompts,
                   help="answer at most this many prompts (default: all)")  # fmt: skip
    g.add_argument("--self-distill-max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    g.add_argument("--self-distill-batch-size", type=int, default=d.batch_size,
                   help="requests generated at once (engine max running requests)")  # fmt: skip
    g.add_argument("--self-distill-cache-dir", default=d.cache_dir,
                   help="default: <EAGLESERVE_CACHE>/self_distill")  # fmt: skip


def self_distill_config(ns: argparse.Namespace) -> SelfDistillConfig:
    kw = {f.name: getattr(ns, f"self_distill_{f.name}") for f in fields(SelfDistillConfig)
          if f.name not in ("mode", "seed")}  # fmt: skip
    return SelfDistillConfig(mode=ns.self_distill, seed=ns.seed, **kw)


def chat_prompt_ids(tok: object, user: str) -> list[int]:
    """A one-turn chat request's prompt ids, rendered as server/chat.py renders it."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


def distill_prompts(
    tok: object, convs: list[list[dict[str, str]]], probes: list[str], cfg: SelfDistillConfig
) -> list[list[int]]:
    """Prompt ids of the first user turn of each conversation, in order: benchmark leaks and
    prompts over `max_prompt_tokens` skipped, at most `max_prompts`."""
    out: list[list[int]] = []
    for conv in convs:
        if cfg.max_prompts is not None and len(out) >= cfg.max_prompts:
            break
        if leaks(conv, probes):
            continue
        ids = chat_prompt_ids(tok, conv[0]["content"])
        if len(ids) <= cfg.max_prompt_tokens:
            out.append(ids)
    return out


def sampling_params(cfg: SelfDistillConfig, index: int) -> SamplingParams:
    """Greedy at temperature 0; else a seed of its own per prompt, so an answer does not
    depend on which batch it ran in (as far as the kernels are batch-invariant)."""
    if cfg.temperature <= 0:
        return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          seed=(cfg.seed * 1_000_003 + index) % SEED_BOUND)  # fmt: skip


def cache_key(model_id: str, engine_kind: str, cfg: SelfDistillConfig,
              prompts: list[list[int]]) -> str:  # fmt: skip
    """Hash of everything the answers depend on: model, its form on the device, the settings
    that change tokens (not the batch size or cache folder), and the prompt ids."""
    settings = {"model": model_id, "engine": engine_kind, "max_new_tokens": cfg.max_new_tokens,
                "temperature": cfg.temperature,
                "seed": cfg.seed if cfg.temperature > 0 else None}  # fmt: skip
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    h.update(json.dumps(prompts, separators=(",", ":")).encode())
    return h.hexdigest()[:24]


def model_identity(path: str) -> str:
    """The model path with the sizes and mtimes of its files (a replaced checkpoint misses)."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path)) if os.path.isdir(path) else []  # fmt: skip
    stamp = [(os.path.basename(f), os.path.getsize(f), int(os.path.getmtime(f)))
             for f in files if os.path.isfile(f)]  # fmt: skip
    return json.dumps([os.path.abspath(path), stamp])


def generate_answers(
    engine: object, prompts: list[list[int]], cfg: SelfDistillConfig
) -> tuple[list[list[int]], dict[str, float]]:
    """The engine's answers to `prompts` (token ids), in chunks of a few batches so the bar
    moves; returns them and {prompts, tokens, seconds, tok_per_s}."""
    answers: list[list[int]] = []
    chunk = 4 * cfg.batch_size
    bar = tqdm(total=len(prompts), desc="Self-distill answers", unit="prompt")
    t0, n_tok = time.time(), 0
    for a in range(0, len(prompts), chunk):
        part = prompts[a : a + chunk]
        params = [sampling_params(cfg, a + i) for i in range(len(part))]
        for out in engine.generate(part, params):
            answers.append(list(out["token_ids"]))
            n_tok += len(out["token_ids"])
        bar.update(len(part))
        bar.set_postfix(tok_per_s=f"{n_tok / max(time.time() - t0, 1e-9):.0f}")
    bar.close()
    secs = time.time() - t0
    return answers, {"prompts": len(prompts), "tokens": n_tok, "seconds": secs,
                     "tok_per_s": n_tok / max(secs, 1e-9)}  # fmt: skip


def self_distill_items(
    make_engine: Callable[[], object],
    prompts: list[list[int]],
    cfg: SelfDistillConfig,
    key: str,
    cache_root: str,
    max_seq_len: int,
) -> tuple[list[Item], dict]:
    """(items, stats): each prompt + its answer, flags on the answer, cut at `max_seq_len`.
    Reads `<cache_root>/<key>.json` when it exists; else builds the engine with `make_engine`
    (only then: its KV pool is freed with it before training), generates, and writes it."""
    path = os.path.join(cache_root, f"{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        answers, stats = data["answers"], {**data["stats"], "cached": True, "path": path}
    else:
        engine = make_engine()
        answers, stats = generate_answers(engine, prompts, cfg)
        del engine
        gc.collect()  # the engine's KV pool and graphs go before the features
        os.makedirs(cache_root, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"settings": asdict(cfg), "prompts": prompts, "answers": answers,
                       "stats": stats}, f)  # fmt: skip
        os.replace(tmp, path)  # a crash never leaves a half-written cache entry
        stats = {**stats, "cached": False, "path": path}
    items: list[Item] = []
    for p, ans in zip(prompts, answers, strict=True):
        ids = (p + ans)[:max_seq_len]
        flags = ([False] * len(p) + [True] * len(ans))[:max_seq_len]
        if any(flags[1:]):
            items.append((ids, flags))
    return items, stats

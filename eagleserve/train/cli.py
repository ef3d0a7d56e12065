"""`eagleserve train-draft`: self-distill an EAGLE head for a served Llama-family model."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from eagleserve.train.data import build_dataset, first_human_turns, sharegpt_path, split_held_out
from eagleserve.train.trainer import TrainConfig, target_features, train_head


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE head for a model by self-distillation",
        description="The engine answers ShareGPT prompts with the target itself; the head learns "
        "the target's next features and tokens. Writes the published EAGLE checkpoint format.",
    )
    p.add_argument("--model", required=True, help="target: HF folder, .gguf, or 'default'")
    p.add_argument("--out", required=True, help="output folder (checkpoints, data cache, log)")
    p.add_argument(
        "--algorithm",
        default="EAGLE",
        choices=["EAGLE"],
        help="head type (EAGLE-1/2; EAGLE3 training is not implemented)",
    )
    p.add_argument("--num-prompts", type=int, default=1500, help="ShareGPT prompts to answer")
    p.add_argument(
        "--prompt-ids-file",
        default=None,
        help="JSON list of token-id prompts instead of ShareGPT (no tokenizer needed)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--ttt-steps", type=int, default=2, help="unrolled passes on own features")
    p.add_argument("--max-minutes", type=float, default=60.0, help="training time budget")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.set_defaults(func=run)
    return p


def run(ns: argparse.Namespace) -> int:
    from eagleserve import Engine
    from eagleserve.spec.head_loader import init_eagle_head, load_eagle_head, save_eagle_head

    torch.manual_seed(ns.seed)
    os.makedirs(ns.out, exist_ok=True)
    t_start = time.time()
    engine = Engine(
        model=ns.model,
        device="cpu",
        disable_overlap_schedule=True,
        max_running_requests=ns.gen_batch_size,
        kv_cache_tokens=ns.gen_batch_size * (ns.max_prompt_tokens + ns.max_new_tokens + 8),
    )
    data_path = os.path.join(ns.out, "data.pt")
    if os.path.exists(data_path):
        seqs = torch.load(data_path)["sequences"]
        source = "cached"
    else:
        if ns.prompt_ids_file:
            with open(ns.prompt_ids_file) as f:
                prompts = json.load(f)
            source = ns.prompt_ids_file
        else:
            prompts = split_held_out(first_human_turns(sharegpt_path()), ns.num_prompts, ns.seed)
            source = f"ShareGPT_V3 first human turns, {len(prompts)} sampled (seed {ns.seed})"
        seqs = build_dataset(
            engine, prompts, ns.max_new_tokens, ns.max_prompt_tokens, ns.gen_batch_size
        )
        torch.save({"sequences": seqs, "source": source}, data_path)
    t_data = time.time()
    runner = engine.scheduler.worker.runner
    feats = target_features(runner, seqs, ns.max_len)
    state = None
    ckpt = os.path.join(ns.out, "trainer_state.pt")
    if ns.resume and os.path.exists(ckpt):
        head = load_eagle_head(
            ns.out, ns.algorithm, runner.model, torch.device("cpu"), torch.float32
        )
        state = torch.load(ckpt, weights_only=False)
    else:
        head = init_eagle_head(ns.algorithm, runner.model, seed=ns.seed)
    head.train()
    for p in runner.model.parameters():
        p.requires_grad_(False)
    cfg = TrainConfig(
        out_dir=ns.out,
        lr=ns.lr,
        batch_size=ns.batch_size,
        max_len=ns.max_len,
        epochs=ns.epochs,
        max_minutes=ns.max_minutes,
        ttt_steps=ns.ttt_steps,
        save_every=ns.save_every,
        seed=ns.seed,
        max_steps=ns.max_steps,
    )
    metrics = train_head(head, seqs, feats, cfg, state)
    if ns.export_dtype == "bfloat16":
        head = head.to(torch.bfloat16)
    save_eagle_head(head.eval(), ns.out)
    log = {
        "model": ns.model,
        "algorithm": ns.algorithm,
        "source": source,
        "sequences": len(seqs),
        "tokens": sum(len(s) for s in seqs),
        "data_minutes": (t_data - t_start) / 60,
        "total_minutes": (time.time() - t_start) / 60,
        "metrics": metrics,
        "args": {k: v for k, v in vars(ns).items() if k != "func"},
    }
    with open(os.path.join(ns.out, "training_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    print(json.dumps({k: log[k] for k in ("sequences", "tokens", "metrics")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagleserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    raise SystemExit(main())

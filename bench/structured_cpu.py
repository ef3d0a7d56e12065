"""Structured output on CPU: free-form vs json_schema, with and without EAGLE, in one run.

    python bench/structured_cpu.py [--prompts 6] [--new-tokens 128] [--rounds 3] [--threads 1]

The default model (packed target as served) on held-out prompts (bench/data.py's math prompts,
written for this repo, never seen in training, each asking for a JSON answer), greedy, one
request at a time. The same prompts run free (text) and constrained by a JSON schema; each
through target-only, EAGLE with the built-in EAGLE-3 head as a fixed 3-step chain, and EAGLE as
`make serve` runs it (adaptive depth 0..3). Per setting: tokens/s over the tokens each request
really produced (prefill included; JSON ends at EOS once the object closes), tau (accepted length
per verify, the bonus token included) and losslessness (the setting's token ids == target-only's,
per request, every round); JSON answers are parsed and validated. Prints a table; writes
bench/results/structured_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import data  # noqa: E402
from bench.common import (  # noqa: E402
    against_baseline,
    interleaved_rounds,
    machine,
    machine_info,
    print_table,
    write_json,
)
from bench.gpu_table import chain  # noqa: E402
from eagleserve import Engine, SamplingParams  # noqa: E402
from eagleserve.sampling_params import GrammarSpec  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "number"},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 3},
    },
    "required": ["answer", "steps"],
}
JSON_HINT = ' Reply in JSON: {"answer": <number>, "steps": [<short strings>]}.'
SPEC = chain(3)  # the built-in EAGLE-3 head, a fixed 3-step chain


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    before = engine.stats()
    t0 = time.perf_counter()
    outs = [engine.generate([p], params)[0] for p in prompts]
    dt = time.perf_counter() - t0
    after = engine.stats()
    tokens = [o["token_ids"] for o in outs]
    res: dict[str, Any] = dict(tok_s=sum(map(len, tokens)) / dt, seconds=dt, tokens=tokens,
                               texts=[o["text"] for o in outs])  # fmt: skip
    calls = after.spec_verify_calls_total - before.spec_verify_calls_total
    if calls:
        res["tau"] = (after.spec_accepted_tokens_total - before.spec_accepted_tokens_total) / calls
    return res


def valid_json(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(model="default", device="cpu", max_total_tokens=4096, max_running_requests=4,
                  disable_overlap_schedule=True)  # fmt: skip
    engines = {
        "target-only": Engine(**common),
        "EAGLE chain 3": Engine(**common, **SPEC),
        "EAGLE adaptive": Engine(**common, **SPEC, speculative_adaptive=True),
    }
    tok = engines["target-only"].tokenizer
    questions = data.math(args.prompts)
    modes = {
        "free-form": ([data.chat_ids(tok, q + JSON_HINT) for q in questions], None),
        "json_schema": ([data.chat_ids(tok, q + JSON_HINT) for q in questions],
                        GrammarSpec("json_schema", json.dumps(SCHEMA))),
    }  # fmt: skip
    for eng in engines.values():  # warm-up (kernels, the grammar compile)
        eng.generate([modes["json_schema"][0][0]],
                     SamplingParams(max_new_tokens=4, grammar=modes["json_schema"][1]))  # fmt: skip

    # Interleaved rounds, the order reversed every other round; the median round per setting
    # (other work on a shared machine moves single runs by tens of percent).
    def one(mode: str, name: str) -> dict[str, Any]:
        prompts, grammar = modes[mode]
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, grammar=grammar)
        return run(engines[name], prompts, params)

    runs = interleaved_rounds(args.rounds, list(modes), list(engines), one)
    rows: list[dict[str, Any]] = []
    for mode in modes:
        for name in engines:
            rs = runs[(mode, name)]
            cell = against_baseline(rs, runs[(mode, "target-only")])
            valid = sum(map(valid_json, rs[0]["texts"])) / len(questions)
            rows.append(dict(mode=mode, setting=name, tok_s=cell["tok_s"],
                             speedup=cell["speedup"], tok_s_rounds=cell["tok_s_rounds"],
                             tau=cell["tau"], tokens=sum(map(len, rs[0]["tokens"])),
                             lossless=cell["equal"] / cell["compared"],
                             valid_json=valid))  # fmt: skip
    print(f"machine: {machine()}")
    print_table(
        ["mode", "setting", "tokens", "tok/s", "speedup", "tau", "lossless", "valid JSON"],
        [
            [
                r["mode"],
                r["setting"],
                r["tokens"],
                r["tok_s"],
                r["speedup"],
                "-" if r["tau"] is None else r["tau"],
                r["lossless"],
                r.get("valid_json", "-"),
            ]
            for r in rows
        ],  # fmt: skip
        title=f"structured output, {len(questions)} held-out prompts, greedy, batch 1, "
        f"median of {args.rounds} interleaved rounds",
    )
    payload = dict(machine=machine_info(), schema=SCHEMA, new_tokens=args.new_tokens, rows=rows)
    path = write_json("structured_cpu.json", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

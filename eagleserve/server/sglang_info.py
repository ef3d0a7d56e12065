"""SGLang's informational routes, for the tools that read them: `GET /get_model_info` and
`GET /get_server_info` (also under SGLang's newer names, `/model_info` and `/server_info`).

The server info is the server's flags (SGLang's names where one exists, as eagleserve's CLI
uses them; the API key left out), the engine's sizes and, as SGLang's `internal_states`, the
running averages its benchmarks print (`avg_spec_accept_length` under speculation).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eagleserve.config import ServerArgs
from eagleserve.messages import EngineReady, EngineStats


def model_info(args: ServerArgs, ready: EngineReady | None) -> dict[str, Any]:
    path = ready.model_path if ready is not None else args.model
    return {"model_path": path, "tokenizer_path": path, "is_generation": True,
            "served_model_name": args.served_model_name or args.model,
            "vocab_size": ready.vocab_size if ready is not None else None}  # fmt: skip


def server_info(args: ServerArgs, ready: EngineReady | None, stats: EngineStats) -> dict[str, Any]:
    flags = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
    state: dict[str, Any] = {"num_running_reqs": stats.num_running,
                             "num_waiting_reqs": stats.num_waiting}  # fmt: skip
    if args.spec_config is not None:  # tokens committed per verify step, the bonus included
        verifies = stats.spec_verify_calls_total
        state["avg_spec_accept_length"] = (
            stats.spec_accepted_tokens_total / verifies if verifies else None
        )
    return {
        **flags,
        "context_length": ready.max_context_len if ready is not None else args.context_length,
        "max_total_num_tokens": stats.kv_total_tokens or args.max_total_tokens,
        "device_name": ready.device_name if ready is not None else None,
        "internal_states": [state],
    }

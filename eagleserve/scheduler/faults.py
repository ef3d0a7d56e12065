"""Fault injection (tests only): with `EAGLESERVE_FAULT_INJECT_TOKEN=<id>` in the environment,
every forward of a batch that holds a request whose prompt *starts with* token `<id>` raises
`RuntimeError("injected fault ...")` inside the worker. The scheduler must then fail exactly
that batch's requests (500) and keep serving the others. Unset (the default): no wrapper at all.

Its own module so the engine loop and every TP rank (tp_engine) install it without importing
each other.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("eagleserve.engine")
FAULT_INJECT_ENV = "EAGLESERVE_FAULT_INJECT_TOKEN"


def install_fault_injection(scheduler: Any, env: dict[str, str] | os._Environ = os.environ) -> None:
    """Wraps the worker's forward so batches with a trigger prompt raise (see module doc)."""
    raw = env.get(FAULT_INJECT_ENV)
    if not raw:
        return
    trigger = int(raw)
    worker = scheduler.worker
    real = worker.forward_batch_generation

    def faulty(batch: Any, *args: Any, **kwargs: Any) -> Any:
        if any(r.origin_input_ids[:1] == [trigger] for r in batch.reqs):
            raise RuntimeError(f"injected fault ({FAULT_INJECT_ENV}={trigger})")
        return real(batch, *args, **kwargs)

    worker.forward_batch_generation = faulty
    logger.warning("fault injection on: prompts starting with token %d fail", trigger)

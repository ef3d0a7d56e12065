"""A served engine logs its throughput and its speculation's acceptance every interval it has
work (scheduler/stats_log.py), with --log-level info."""

from __future__ import annotations

import random
import re
import time

import httpx
from server_fixtures import STATS_INTERVAL_S, ServerProcess, spec_server_fixture  # noqa: F401


def test_a_served_engine_logs_its_stats(spec_server: ServerProcess) -> None:
    n_tokens = random.randint(48, 96)
    body = {"prompt": "Once upon a time", "max_tokens": n_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200
    time.sleep(3 * STATS_INTERVAL_S)  # the interval the request ended in is logged at its end
    spec_server.log.seek(0)
    text = spec_server.log.read()
    rates = [float(x) for x in re.findall(r"generation throughput ([0-9.]+) tokens/s", text)]
    assert rates and max(rates) > 0, text[-3000:]
    assert re.search(r"speculation: mean acceptance length [0-9.]+, drafts accepted \d+ of \d+",
                     text), text[-3000:]  # fmt: skip

"""A served engine logs its throughput and its speculation's acceptance every interval it has
work (scheduler/stats_log.py), with --log-level info."""

from __future__ import annotations

import random
import re
import time

import httpx
from server_fixtures import ServerProcess

from eagleserve.scheduler.stats_log import INTERVAL_ENV


def test_a_served_engine_logs_its_stats() -> None:
    srv = ServerProcess(
        ["--log-level", "info", "--speculative-algorithm", "EAGLE3",
         "--speculative-draft-model-path", "builtin:smollm2-135m-eagle",
         "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"],
        env={INTERVAL_ENV: "0.5"},
    )  # fmt: skip
    try:
        n_tokens = random.randint(48, 96)
        body = {"prompt": "Once upon a time", "max_tokens": n_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        resp = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200
        time.sleep(1.5)  # the interval the request ended in is logged at its end
        srv.log.seek(0)
        text = srv.log.read()
    finally:
        srv.stop()
    rates = [float(x) for x in re.findall(r"generation throughput ([0-9.]+) tokens/s", text)]
    assert rates and max(rates) > 0, text[-3000:]
    assert re.search(r"speculation: mean acceptance length [0-9.]+, drafts accepted \d+ of \d+",
                     text), text[-3000:]  # fmt: skip

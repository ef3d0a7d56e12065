"""`eagleserve bench serve` against real servers: every request answered and counted by the
server's own usage, the concurrency bound kept, the server's device named, and under speculation
tau and the acceptance by depth from the server's counters; failures are one line and exit 1."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_fixtures import (  # noqa: F401 (fixtures)
    ServerProcess,
    server_fixture,
    spec_server_fixture,
)

from eagleserve.benchmark.datasets import random_prompts
from eagleserve.cli import main


def bench(url: str, tmp_path, *flags: str) -> dict:
    code = main(["bench", "serve", "--base-url", url, "--disable-tqdm", "--save-detailed",
                 "--result-dir", str(tmp_path), "--result-filename", "r.json", *flags])  # fmt: skip
    assert code == 0
    return json.loads((tmp_path / "r.json").read_text())


def most_in_flight(requests: list[dict]) -> int:
    events = sorted([(r["start"], 1) for r in requests]
                    + [(r["start"] + r["latency"], -1) for r in requests])  # fmt: skip
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return peak


def test_random_prompts_are_answered_and_counted(server: ServerProcess, tmp_path, capsys) -> None:
    rng = random.Random()
    n, in_len, out_len, conc = rng.randint(5, 8), rng.randint(16, 48), rng.randint(4, 10), 2
    seed = rng.randrange(1000)
    r = bench(server.url, tmp_path, "--num-prompts", str(n), "--random-input-len", str(in_len),
              "--random-output-len", str(out_len), "--ignore-eos", "--max-concurrency",
              str(conc), "--seed", str(seed))  # fmt: skip
    assert r["completed"] == n and r["failed"] == 0
    # Token-id prompts are sent as they are; ignore_eos runs every answer to max_tokens.
    assert r["total_input_tokens"] == n * in_len and r["total_output_tokens"] == n * out_len
    assert most_in_flight(r["requests"]) <= conc
    for req in r["requests"]:
        assert 0 < req["ttft"] <= req["latency"] and len(req["itls"]) <= out_len - 1
    # The answers recorded are the server's own (greedy: as asked alone, not streamed).
    vocab = httpx.get(server.url + "/get_model_info").json()["vocab_size"]
    prompts = random_prompts(n, in_len, out_len, 0.0, 0, vocab, random.Random(seed))
    for i in rng.sample(range(n), 2):
        body = {"prompt": prompts[i].prompt, "max_tokens": out_len, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        alone = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert r["requests"][i]["generated_text"] == alone["choices"][0]["text"]
    info = httpx.get(server.url + "/get_server_info").json()
    assert r["device"] == info["device_name"] and "x" in r["device"]  # a CPU: model x cores
    assert "spec_accept_length" not in r
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and f"{n * out_len}" in out
    assert "Speculative Decoding" not in out


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_answers_not_streamed_are_the_streamed_ones_timed_whole(
    server: ServerProcess, tmp_path, endpoint: str
) -> None:
    """--disable-stream: the same answers as streamed, each request's TTFT its latency (its
    client saw every token at once) and no TPOT or ITL."""
    rng = random.Random()
    n, out_len = rng.randint(3, 6), rng.randint(6, 12)
    flags = ["--endpoint", endpoint, "--num-prompts", str(n), "--random-input-len", "24",
             "--random-output-len", str(out_len), "--ignore-eos", "--seed",
             str(rng.randrange(1000)), "--percentile-metrics", "ttft,tpot,itl,e2el"]  # fmt: skip
    streamed = bench(server.url, tmp_path, *flags)
    whole = bench(server.url, tmp_path, *flags, "--disable-stream")
    assert whole["completed"] == n and whole["total_output_tokens"] == n * out_len
    texts = [q["generated_text"] for q in whole["requests"]]
    assert texts == [q["generated_text"] for q in streamed["requests"]] and all(texts)
    for q in whole["requests"]:
        assert q["ttft"] == q["latency"] > 0 and q["itls"] == [] and not q["streamed"]
    assert whole["mean_tpot_ms"] == 0 == whole["mean_itl_ms"] < streamed["mean_tpot_ms"]
    assert whole["mean_ttft_ms"] == pytest.approx(whole["mean_e2el_ms"])


def test_speculation_reports_tau_and_acceptance_by_depth(
    spec_server: ServerProcess, tmp_path
) -> None:
    """Chat prompts from a JSONL file on the EAGLE3 chain-3 server: every committed token after
    a request's first comes from a verify step, so tau x steps covers the answers' tokens."""
    rng = random.Random()
    topics = ["the sea", "a city at night", "bread", "mountains", "a library", "rain"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Write two sentences about {t}."}) + "\n"
                            for t in rng.sample(topics, 4)))  # fmt: skip
    r = bench(spec_server.url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name",
              "custom", "--dataset-path", str(path), "--custom-output-len", "24",
              "--num-prompts", "4", "--ignore-eos")  # fmt: skip
    assert r["completed"] == 4 and r["total_output_tokens"] == 4 * 24
    depths = r["spec_acceptance_by_depth"]
    assert len(depths) == 3 and all(0 <= a <= 1 for a in depths)
    tau, steps = r["spec_accept_length"], r["spec_verify_steps"]
    # A chain cut where the head is unsure drafts fewer: depth d's share is of the steps that
    # drafted to it, and tau counts every accepted draft over every step.
    drafted = r["spec_drafted_by_depth"]
    assert steps == drafted[0] >= drafted[1] >= drafted[2] > 0
    accepted = sum(a * n for a, n in zip(depths, drafted, strict=True))
    assert 1 <= tau <= 4 and tau == pytest.approx(1 + accepted / steps)
    # Every token after a request's first is committed by a verify step; the last step of an
    # answer may accept up to 3 past its max_tokens. The test request and warm-ups are not
    # counted (they would add a whole answer's steps).
    out = r["total_output_tokens"] - 4
    assert out - 1e-6 <= tau * steps <= out + 4 * 3 + 1e-6 and steps <= out


def test_failures_are_one_line_and_exit_1(server: ServerProcess, tmp_path, capsys) -> None:
    cases = [
        (["--base-url", "http://127.0.0.1:9"], "cannot reach"),
        (["--base-url", server.url, "--model", "no-such-model"], "no model 'no-such-model'"),
        (["--base-url", server.url, "--percentile-metrics", "ttft,speed"], "speed"),
        (["--base-url", server.url, "--dataset-name", "custom"], "--dataset-path"),
        # Over the server's context: the first request is refused, the run does not start.
        (["--base-url", server.url, "--random-input-len", "9000", "--num-prompts", "1"],
         "the first request failed: HTTP 400"),
    ]  # fmt: skip
    for flags, said in cases:
        assert main(["bench", "serve", "--disable-tqdm", *flags]) == 1, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, (flags, err)

"""Under load, with speculation on: nothing lost, greedy and seeded text exact, KV empty
afterwards; requests that never fit get 400; requests that overflow the KV pool together still
finish exactly."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
from rel_fixtures import (  # noqa: F401 (fixtures)
    REPO,
    SMALL_KV,
    Server,
    completion,
    metric,
    run_bench,
    spec_server_fixture,
    tiny_dirs_fixture,
    wait_kv_free,
)

from eagleserve import Engine, SamplingParams


def test_load_bench_with_spec(tiny_dirs: tuple[str, str], tmp_path: os.PathLike) -> None:
    target, head = tiny_dirs
    args = ["--model", target, "--dtype", "float32", "--spec", "--algorithm", "EAGLE", "--draft",
            head, "--clients", "16", "--duration", "12", "--max-total-tokens", str(SMALL_KV),
            "--max-running-requests", "16", "--max-tokens", "16", "--long-max-tokens", "48",
            "--long-repeats", "1,2"]  # fmt: skip
    rc, s, detail = run_bench("load.py", args, os.path.join(tmp_path, "load.json"))
    assert rc == 0 and s["ok"], detail
    assert s["lost"] == 0 and s["errors"] == 0, detail
    assert s["completed_greedy"] > 10 and s["greedy_exact"] == s["completed_greedy"], detail
    assert s["completed_seeded"] > 0 and s["seeded_exact"] == s["completed_seeded"], detail
    assert s["aborted_by_client"] > 0, detail  # the disconnect path was exercised
    # Speculation ran and is reported: tau counts the verify's own token, so it is at least 1.
    assert s["speculation"]["tau"] >= 1.0 and s["speculation"]["acceptance_by_depth"], detail
    # Penalties / logit_bias / min_tokens, stop strings, n choices, prompt lists, output
    # constraints, logprobs and echo + logprobs were in the mix (and exact, logprobs included).
    assert s["completed_with_penalties"] > 3 and s["completed_echo_logprobs"] > 0, detail
    assert s["completed_with_stop"] > 0 and s["completed_n_choices"] > 0, detail
    assert s["completed_multi_prompt"] > 0, detail
    assert s["completed_structured"] > 0 and s["completed_logprobs"] > 0, detail
    assert s["kv_used_tokens_end"] == 0, detail
    assert s["server_exit_code"] == 0, detail


def test_load_bench_multi_turn(tiny_dirs: tuple[str, str], tmp_path: os.PathLike) -> None:
    """Chat conversations re-sending their history: the prefix cache serves most prompt tokens,
    and every greedy answer is still exact; with the overlap scheduler on (the GPU default)."""
    target, head = tiny_dirs
    args = ["--model", target, "--dtype", "float32", "--spec", "--algorithm", "EAGLE", "--draft",
            head, "--multi-turn", "--turns", "3", "--clients", "8", "--duration", "10",
            "--max-total-tokens", str(SMALL_KV), "--max-running-requests", "16", "--max-tokens",
            "16", "--long-max-tokens", "32", "--long-share", "0.1", "--long-repeats", "1,1",
            "--disconnect-share", "0.05", "--no-disable-overlap-schedule"]  # fmt: skip
    rc, s, detail = run_bench("load.py", args, os.path.join(tmp_path, "load_multi_turn.json"))
    assert rc == 0 and s["ok"], detail
    assert s["lost"] == 0 and s["errors"] == 0, detail
    assert s["completed_greedy"] > 10 and s["greedy_exact"] == s["completed_greedy"], detail
    assert s["completed_seeded"] > 0 and s["seeded_exact"] == s["completed_seeded"], detail
    assert s["prefix_cache_hit_rate"] > 0.15, detail  # 0 without the cache
    assert s["kv_used_tokens_end"] == 0, detail


def test_load_bench_with_the_shipped_config(smollm2_dir: str, tmp_path: os.PathLike) -> None:
    """What `make serve` deploys (SmolLM2, its EAGLE3 head, adaptive depth; the config file)
    under a short load: every greedy and seeded answer exact."""
    args = ["--config", "smollm2-135m-eagle", "--model", smollm2_dir, "--clients",
            "4", "--duration", "8", "--max-total-tokens", "1024", "--max-tokens", "12",
            "--long-max-tokens", "24", "--long-repeats", "1,2"]  # fmt: skip
    rc, s, detail = run_bench("load.py", args, os.path.join(tmp_path, "load_shipped.json"))
    assert rc == 0 and s["ok"], detail
    assert s["lost"] == 0 and s["errors"] == 0, detail
    assert s["completed_greedy"] > 5 and s["greedy_exact"] == s["completed_greedy"], detail
    assert s["seeded_exact"] == s["completed_seeded"], detail
    assert s["kv_used_tokens_end"] == 0, detail


def test_never_fits_is_400(spec_server: Server) -> None:
    url = spec_server.url
    ctx = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert ctx <= SMALL_KV
    for prompt, max_tokens in (([5] * 10, ctx - 9), ([5] * ctx, 1), ("hello", 10 * SMALL_KV)):
        resp = completion(url, prompt, max_tokens)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert completion(url, [5] * 10, ctx - 10).status_code == 200  # exactly the limit fits
    wait_kv_free(url)


def test_overflowing_pool_finishes_exact(spec_server: Server, tiny_dirs: tuple[str, str]) -> None:
    """12 requests of ~200 tokens each need ~3x the pool: they queue and get retracted."""
    url = spec_server.url
    prompts = [[3 + (7 * i + j) % 200 for j in range(120 + 10 * i)] for i in range(12)]
    before = metric(url, "eagleserve_num_retracted_total")

    def one(p: list[int]) -> httpx.Response:
        return completion(url, p, 80, ignore_eos=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        resps = list(pool.map(one, prompts))
    assert [r.status_code for r in resps] == [200] * len(prompts), [r.text for r in resps]
    got = [r.json()["choices"][0]["text"] for r in resps]
    assert metric(url, "eagleserve_num_retracted_total") > before, "no retraction happened"
    wait_kv_free(url)
    target, head = tiny_dirs
    eng = Engine(model=target, device="cpu", dtype="float32", max_total_tokens=4096,
                 speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                 speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4)  # fmt: skip
    want = eng.generate(prompts, SamplingParams(max_new_tokens=80, temperature=0, ignore_eos=True))
    assert got == [w["text"] for w in want]

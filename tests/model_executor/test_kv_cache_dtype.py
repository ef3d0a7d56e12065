"""--kv-cache-dtype: which element type the target's K/V pool gets, and what a packed CPU target
relies on with its fp16 default: a key's pool bits do not depend on the forward that stored it
(one-shot prefill, chunked prefill, the prefix cache, decode), so answers do not either."""

from __future__ import annotations

import pytest
import torch

from eagleserve import Engine, SamplingParams
from eagleserve.kernels import cpu_ext
from eagleserve.model_executor.model_runner import resolve_kv_cache_dtype

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_auto_is_fp16_where_the_cpu_kernel_reads_the_pool_else_the_models() -> None:
    assert resolve_kv_cache_dtype("auto", torch.float32, CPU, row_kernel=True) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32, CPU, row_kernel=False) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, GPU, row_kernel=False) == torch.bfloat16
    assert resolve_kv_cache_dtype("FP32", torch.float32, CPU, row_kernel=True) == torch.float32
    assert resolve_kv_cache_dtype("bf16", torch.float32, CPU, row_kernel=False) == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, GPU, row_kernel=False) == (
        torch.bfloat16
    )


@pytest.mark.parametrize(
    ("value", "device", "row_kernel", "says"),
    [
        ("bfloat16", CPU, True, "float32 or float16"),  # the CPU kernel reads neither bf16
        ("float16", GPU, False, "model's dtype"),
        ("fp8_e4m3", CPU, False, "auto, float32, float16 or bfloat16"),
    ],
)
def test_a_pool_type_that_cannot_run_is_a_clear_error(
    value: str, device: torch.device, row_kernel: bool, says: str
) -> None:
    model_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with pytest.raises(ValueError, match=says):
        resolve_kv_cache_dtype(value, model_dtype, device, row_kernel)


@pytest.mark.skipif(not cpu_ext.load(), reason="the CPU kernels do not run here")
def test_the_fp16_pool_gives_the_same_tokens_however_the_prompt_was_prefilled() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompt = torch.randint(200, 40000, (150,), generator=gen).tolist()
    follow = prompt + torch.randint(200, 40000, (40,), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    answers = {}
    for chunk in (0, 16):
        with Engine(model="default", device="cpu", max_total_tokens=1024,
                    max_running_requests=2, chunked_prefill_size=chunk) as engine:  # fmt: skip
            pool = engine.scheduler.worker.runner.token_to_kv_pool
            assert pool.dtype == torch.float16, "a packed CPU target's default pool"
            # The second prompt extends the first: with the radix cache it reuses its K/V.
            answers[chunk] = [engine.generate([p], params)[0]["token_ids"]
                              for p in (prompt, follow)]  # fmt: skip
    with Engine(model="default", device="cpu", max_total_tokens=1024, max_running_requests=2,
                disable_radix_cache=True) as cold:  # fmt: skip
        answers["no prefix cache"] = [cold.generate([follow], params)[0]["token_ids"]]
    assert answers[0] == answers[16]
    assert answers["no prefix cache"][0] == answers[0][1]


@pytest.mark.skipif(not cpu_ext.load(), reason="the CPU kernels do not run here")
def test_float32_is_kept_when_asked_for() -> None:
    with Engine(model="default", device="cpu", max_total_tokens=256, max_running_requests=1,
                kv_cache_dtype="float32") as engine:  # fmt: skip
        pool = engine.scheduler.worker.runner.token_to_kv_pool
        assert pool.dtype == torch.float32 and pool.k_buffer[0].dtype == torch.float32
        out = engine.generate(["Name three colors."], SamplingParams(max_new_tokens=4))[0]
        assert len(out["token_ids"]) > 0

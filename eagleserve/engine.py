"""Offline API: `Engine(model=...).generate(prompts, sampling_params)` and
`.chat(conversations, sampling_params)` in this process (vLLM's `LLM.generate` and `LLM.chat`)."""

from __future__ import annotations

import itertools
from dataclasses import fields, replace
from typing import Any

from tqdm import tqdm

from eagleserve.config import ServerArgs, renamed_hint
from eagleserve.messages import (
    EngineStats,
    GenerateReqInput,
    ProfileReq,
    ProfileResult,
    TokenOutput,
)
from eagleserve.sampling_params import SamplingParams
from eagleserve.scheduler.output_processor import response_text, text_before_stop, text_ids
from eagleserve.scheduler.profiler import EngineProfiler
from eagleserve.scheduler.scheduler import Scheduler
from eagleserve.scheduler.tp_engine import ReplicatedScheduler, build_scheduler


class Engine:
    """Runs the scheduler in-process. Keyword arguments are `ServerArgs` fields. With
    `tp_size > 1` the other ranks are spawned processes, which import the main module again:
    build it under `if __name__ == "__main__":`, and `close()` it (or use `with`) before
    building another."""

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        known = {f.name for f in fields(ServerArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown Engine arguments: {sorted(unknown)}{renamed_hint(unknown)}")
        self.args = ServerArgs(model=model, **kwargs)
        # --tp-size > 1: this process is rank 0 and starts the other ranks (close() stops them).
        self.scheduler: Scheduler | ReplicatedScheduler = build_scheduler(self.args)
        self.tokenizer = self.scheduler.tokenizer
        self._ids = itertools.count()
        self.profiler = EngineProfiler()

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Returns, per prompt, {"text", "token_ids", "finish_reason", "spec_accept_length"};
        where `logprobs` was asked for, "logprobs" (one per token) and "top_logprobs" (per token,
        its `logprobs` most likely alternatives as (token id, logprob)); where
        `prompt_logprobs` was, "prompt_logprobs" (None first). `use_tqdm`: a bar counts the
        finished prompts (on a terminal, for more than one). `priority`: each prompt's, with
        `enable_priority_scheduling` (vLLM's argument)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        priorities = [0] * len(prompts) if priority is None else priority
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts")
        rids = []
        for prompt, p, pri in zip(prompts, plist, priorities):
            ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            rids.append(rid)
            self.scheduler.add_request(GenerateReqInput(rid, ids, replace(p), priority=pri))
        done: dict[str, TokenOutput] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        scores: dict[str, list[float | None]] = {}
        lps: dict[str, list[float]] = {rid: [] for rid in rids}
        tops: dict[str, list[list[tuple[int, float]]]] = {rid: [] for rid in rids}
        error: str | None = None
        bar = tqdm(total=len(rids), desc="Processed prompts", unit="prompt",
                   disable=None if use_tqdm and len(rids) > 1 else True)  # fmt: skip
        while len(done) < len(rids):
            for out in self.profiler.step(self.scheduler.step):
                if out.rid not in tokens:
                    continue
                if out.error is not None and error is None:
                    # One bad request fails the call: drop the others, keep the engine clean.
                    error = out.error
                    for rid in rids:
                        if rid not in done and rid != out.rid:
                            self.scheduler.abort_request(rid)
                tokens[out.rid].extend(out.new_token_ids)
                lps[out.rid].extend(out.logprobs or [])
                tops[out.rid].extend(out.top_logprobs or [])
                if out.prompt_logprobs is not None:
                    scores[out.rid] = out.prompt_logprobs.logprobs
                if out.finished:
                    done[out.rid] = out
                    bar.update()
        bar.close()
        # Let a forward still in flight land so every slot is back in the pool.
        while self.scheduler.has_work() and not self.scheduler.waiting:
            self.scheduler.step()
        if error is not None:
            raise ValueError(error)
        results = []
        for rid, p in zip(rids, plist):
            out = done[rid]
            result: dict[str, Any] = {
                "token_ids": tokens[rid],
                "text": self._decode(tokens[rid], out.matched_stop, p),
                "finish_reason": out.finish_reason,
                "spec_accept_length": out.spec_accept_length,
            }
            if p.logprobs is not None:
                result["logprobs"], result["top_logprobs"] = lps[rid], tops[rid]
            if p.prompt_logprobs is not None:
                result["prompt_logprobs"] = scores.get(rid)
            results.append(result)
        return results

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """`generate` on conversations (one: a list of messages; several: a list of those)
        rendered by the model's chat template (or `chat_template`), as vLLM's `LLM.chat`: the
        template's text is the prompt, with no special tokens added (it holds those it wants),
        as the server's chat route encodes it; `tools` go to the template."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids to generate")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this model has no chat template: pass chat_template, or generate")
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(
                conv, chat_template=template, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
            )  # fmt: skip
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)

    def start_profile(
        self, output_dir: str | None = None, record_shapes: bool = False, with_stack: bool = False
    ) -> str:
        """Starts the torch profiler over this engine's steps (vLLM's `LLM.start_profile`); the
        trace file it will write (scheduler/profiler.py says where)."""
        req = ProfileReq(True, output_dir, record_shapes=record_shapes, with_stack=with_stack)
        return self._profiled(self.profiler.start(req))

    def stop_profile(self) -> str:
        """Stops the profiler and writes its trace (a gzipped Chrome trace): its path."""
        return self._profiled(self.profiler.stop())

    @staticmethod
    def _profiled(result: ProfileResult) -> str:
        if not result.ok or result.trace_path is None:
            raise RuntimeError(result.message)
        return result.trace_path

    def close(self) -> None:
        """Stops the tensor-parallel ranks this engine started and leaves their group, so that
        another tensor-parallel engine can be built in this process, and ends the overlap
        scheduler's forward thread. Calling it again does nothing."""
        if isinstance(self.scheduler, ReplicatedScheduler):
            self.scheduler.close()
        elif self.scheduler.forwarder is not None:
            self.scheduler.forwarder.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def flush_cache(self) -> int | None:
        """Empties the prefix cache (between benchmark runs, say): the KV slots freed, or None
        while requests added through `scheduler` are still in it (`generate` leaves none)."""
        return self.scheduler.flush_cache()

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        # With the tokenizer's special tokens (a BOS), as the server's completions encode a
        # text prompt.
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _decode(self, ids: list[int], matched_stop: int | str | None, p: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        if isinstance(matched_stop, str):  # a stop string ended it
            return text_before_stop(self.tokenizer, ids, p)
        return response_text(self.tokenizer, text_ids(ids, matched_stop, p), p.skip_special_tokens)

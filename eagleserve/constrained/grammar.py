"""Grammar-constrained decoding with xgrammar: a request's `GrammarSpec` compiled against the
target's tokenizer (LRU-cached per spec), and the per-request matcher.

Invariant (the workers keep it): a request's matcher has accepted exactly the tokens its
forwards have committed, in order. A forward reads the committed tokens of its grammar rows back
to the host and advances their matchers before it returns, and forwards run one after another
(overlap: on one forward thread, in launch order), so the next forward of the request computes
its masks from every token committed before it. That read is a device -> host sync, paid only
by batches that hold a grammar request.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from eagleserve.sampling_params import GrammarSpec

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; clients get the rest.
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """A spec that does not compile; the message names the problem (a 400 to the client)."""


def xgrammar() -> Any:
    """The xgrammar module, or a GrammarError saying how to install it. eagleserve installs it
    without its dependencies (Makefile, Dockerfile): its metadata asks for PyPI's `triton` on
    Linux, which on ROCm would replace torch's pytorch-triton-rocm; the rest it needs is
    eagleserve's own."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise GrammarError(
            "structured output needs the xgrammar package, absent from this server's "
            "environment: pip install --no-deps xgrammar==0.2.8"
        ) from None
    return xgr


@dataclass
class GrammarStats:
    compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0


class GrammarBackend:
    """Compiles specs into xgrammar grammars for one tokenizer; keeps the last `cache_size`."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 128
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.stats = GrammarStats()
        self._compiler: Any = None  # built at the first grammar request (reads the vocabulary)
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(  # no EOS known: xgrammar guesses
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            hit = self.cache.get(spec)
            if hit is not None:
                self.cache.move_to_end(spec)
                self.stats.cache_hits += 1
                return hit
            t0 = time.perf_counter()
            compiled = self._get_compiler().compile_grammar(build_grammar(spec))
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - t0
            self.cache[spec] = compiled
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return compiled

    def new_matcher(self, spec: GrammarSpec) -> RequestGrammar:
        return RequestGrammar(self.compile(spec))


def request_grammar(
    backend: GrammarBackend | None, spec: GrammarSpec
) -> tuple[RequestGrammar | None, str | None]:
    """(the request's matcher, None) or (None, why it cannot have one)."""
    if backend is None:
        return None, "structured output needs a model with a tokenizer"
    try:
        return backend.new_matcher(spec), None
    except GrammarError as exc:
        return None, str(exc)
    except Exception as exc:  # the tokenizer's vocabulary is unusable for xgrammar
        return None, f"structured output is not available for this model: {exc}"


def build_grammar(spec: GrammarSpec) -> Any:
    """The spec as an xgrammar `Grammar` (no tokenizer needed: the HTTP server checks specs with
    it before a request reaches the engine). Raises GrammarError naming the problem."""
    xgr = xgrammar()
    # Compact JSON (no free whitespace): a small model otherwise tends to emit blank runs.
    try:
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.value)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.value)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"invalid {spec.kind}: {_LOCATION.sub('', first)}") from exc
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


@functools.lru_cache(maxsize=256)  # clients resend the same schemas
def check_grammar(spec: GrammarSpec) -> str | None:
    """Why `spec` cannot be served, or None."""
    try:
        build_grammar(spec)
    except GrammarError as exc:
        return str(exc)
    return None


class RequestGrammar:
    """One request's matcher. Only the worker running the request's forward touches it."""

    def __init__(self, compiled: Any) -> None:
        xgr = xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, tokens: list[int]) -> None:
        """Commits `tokens`. A token the grammar rejects (only past a finish, in an iteration
        whose output the scheduler drops) stops the walk."""
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next token's mask at the committed state (none allowed once terminated)."""
        if self.matcher.is_terminated():
            bitmask[row] = 0
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_paths(self, paths: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None:
        """Row first_row + i: the mask after the committed tokens plus paths[i] (a draft path);
        no token allowed where the grammar rejects a path token. The state is restored."""
        m = self.matcher
        for i, path in enumerate(paths):
            n = 0
            for t in path:
                if m.is_terminated() or not m.accept_token(t):
                    break
                n += 1
            if n == len(path):
                self.fill(bitmask, first_row + i)
            else:
                bitmask[first_row + i] = 0
            if n:
                m.rollback(n)

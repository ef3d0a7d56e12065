"""The `eagleserve` command. `eagleserve serve --help` lists every flag.

The flags of `serve` are generated from the `ServerArgs` fields, one flag per field
(`max_running_requests` <-> `--max-running-requests`). Precedence: flags > `--config` YAML file
(keys are field names) > `EAGLESERVE_API_KEY` (for the API key) > the dataclass defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import sys
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, NoReturn

from eagleserve.benchmark.cli import add_bench_parser
from eagleserve.client_cli import add_client_parsers
from eagleserve.config import RENAMED_FIELDS, ServerArgs, renamed_hint
from eagleserve.flag_help import FIELD_GROUPS, FIELD_HELP, VLLM_FLAGS
from eagleserve.server.reasoning import reasoning_format

_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}
# Values checked before anything loads (from flags and from --config files alike), so a typo
# is one line and exit code 2, not a traceback from the engine minutes later.
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"),
    "kv_cache_dtype": ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"),
    "load_format": ("auto", "dummy"),
    "quantization": ("auto", "none", "gguf"),
    "attention_backend": ("auto", "torch", "triton"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "sampling_defaults": ("model", "openai"),
    "tool_call_parser": ("hermes", "qwen25", "llama3", "llama3_json", "mistral"),
}
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")  # HIP builds of torch call their GPUs cuda too
POSITIVE = ("max_running_requests", "max_queued_requests", "max_total_tokens", "context_length",
            "max_request_body_bytes", "cuda_graph_max_bs", "tp_size", "dp_size",
            "dist_timeout", "stream_interval")  # fmt: skip


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one line (argparse's default prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"eagleserve: error: {message} (see `{self.prog} --help`)\n")


def check_values(args: ServerArgs) -> str | None:
    """The first field whose value cannot work, as a message; None when all can."""
    for name, choices in FIELD_CHOICES.items():
        value = getattr(args, name)
        if str(value).lower() not in choices:
            return f"--{name.replace('_', '-')} {value!r}: choose from {', '.join(choices)}"
    if args.reasoning_parser is not None:
        try:
            reasoning_format(args.reasoning_parser)
        except ValueError as exc:
            return str(exc)
    if DEVICE_RE.fullmatch(args.device) is None:
        return f"--device {args.device!r}: choose auto, cpu, cuda or cuda:N"
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: a port is between 0 and 65535"
    for name in POSITIVE:
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} {value}: must be at least 1"
    if not 0 <= args.log_requests_level <= 3:
        return f"--log-requests-level {args.log_requests_level}: choose 0, 1, 2 or 3"
    if args.priority_scheduling_preemption_threshold < 0:  # equals would preempt each other
        return "--priority-scheduling-preemption-threshold: must be at least 0"
    if args.enable_mixed_chunk and args.enable_priority_scheduling:
        # A mixed step allocates the decode slots before it plans the prefill, whose preemption
        # would then have to undo a prepared decode row.
        return "--enable-mixed-chunk does not run with --enable-priority-scheduling"
    if args.enable_mixed_chunk and args.speculative_algorithm:
        return "--enable-mixed-chunk does not run with speculative decoding (requests verify)"
    return None


def _field_type(f: dataclasses.Field) -> tuple[str, bool]:
    """('int' | 'float' | 'str' | 'bool' | other, optional) from the field's annotation."""
    parts = [p.strip() for p in str(f.type).split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    return (parts[0] if len(parts) == 1 else "str"), optional


def serve_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(ServerArgs))


def flag_help(f: dataclasses.Field) -> str:
    """The field's help with its default once (a help text that names its default keeps it)."""
    text = FIELD_HELP.get(f.name, f.name.replace("_", " "))
    if "(default" in text or f.default is None:
        return text
    return f"{text} (default: {f.default})"


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


class ForeignFlag(argparse.Action):
    """A flag eagleserve does not take under that name (renamed to SGLang's, or vLLM's): using
    it is an error that says what to use."""

    def __init__(self, *args: Any, hint: str, **kwargs: Any) -> None:
        self.hint = hint
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        parser.error(f"{option_string} {self.hint}")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="YAML", help="YAML file (or name under configs/) of ServerArgs fields"
    )
    by_name = {f.name: f for f in serve_fields()}
    grouped = {n for names in FIELD_GROUPS.values() for n in names}
    # A field left out of FIELD_GROUPS still gets its flag (one flag per field, always).
    other = tuple(n for n in by_name if n not in grouped)
    hints = {_flag(old): f"is now {_flag(new)} (SGLang's flag name)"
             for old, new in RENAMED_FIELDS.items()}  # fmt: skip
    hints |= {flag: f"is vLLM's flag: {hint}" for flag, hint in VLLM_FLAGS.items()}
    for flag, hint in hints.items():
        parser.add_argument(flag, action=ForeignFlag, nargs="?", hint=hint, help=argparse.SUPPRESS)
    for title, names in {**FIELD_GROUPS, "other": other}.items():
        group = parser.add_argument_group(title)
        for name in names:
            f = by_name[name]
            flag = _flag(name)
            kind, _ = _field_type(f)
            if kind == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=flag_help(f))  # fmt: skip
            else:
                group.add_argument(flag, type=_TYPES.get(kind, str), default=argparse.SUPPRESS,
                                   metavar=kind.upper(), help=flag_help(f))  # fmt: skip


def find_config(name: str) -> Path | None:
    repo = Path(__file__).resolve().parent.parent
    for cand in (
        Path(name),
        Path("configs") / name,
        Path("configs") / f"{name}.yaml",
        repo / name,
        repo / "configs" / f"{name}.yaml",
    ):
        if cand.is_file():
            return cand
    return None


def load_config(name: str) -> dict[str, Any] | str:
    """The YAML file's fields, or an error message."""
    import yaml

    path = find_config(name)
    if path is None:
        return f"config file not found: {name}"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        return f"{path}: not valid YAML ({' '.join(str(exc).split())})"
    if not isinstance(data, dict):
        return f"{path}: expected a mapping of ServerArgs fields"
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    unknown = sorted(set(data) - known)
    if unknown:
        return f"{path}: unknown fields {unknown}{renamed_hint(unknown)} (known: {sorted(known)})"
    for f in serve_fields():
        if f.name in data and not value_fits(f, data[f.name]):
            kind, _ = _field_type(f)
            return f"{path}: {f.name} must be {kind}, not {data[f.name]!r}"
    return data


def value_fits(f: dataclasses.Field, value: Any) -> bool:
    """Whether a YAML value has the field's type (flags are converted by argparse instead)."""
    kind, optional = _field_type(f)
    if value is None:
        return optional
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def build_server_args(ns: argparse.Namespace) -> ServerArgs | str:
    """ServerArgs from parsed flags (+ config file + environment), or an error message."""
    values: dict[str, Any] = {}
    config = getattr(ns, "config", None)
    if config:
        loaded = load_config(config)
        if isinstance(loaded, str):
            return loaded
        values.update(loaded)
    values.update({f.name: getattr(ns, f.name) for f in serve_fields() if hasattr(ns, f.name)})
    if values.get("api_key") is None and os.environ.get("EAGLESERVE_API_KEY"):
        values["api_key"] = os.environ["EAGLESERVE_API_KEY"]
    args = ServerArgs(**values)
    if args.speculative_algorithm:
        try:
            args.spec_config  # noqa: B018 - validates the speculative flags
        except ValueError as exc:
            return str(exc)
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="eagleserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version",
                        version=f"eagleserve {package_version('eagleserve')}")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Start the OpenAI-compatible HTTP server (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics).",
    )
    add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)
    batch = sub.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests offline (vLLM's run-batch)",
        description="Run the requests of an OpenAI batch file (JSONL: custom_id, method, url "
        "of /v1/completions, /v1/chat/completions or /v1/responses, body) through the "
        "server's routes in this process, and write their answers in OpenAI's batch output "
        "format, in the input's order. The serve flags choose the model and engine.",
    )
    batch.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    batch.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL)")
    add_serve_flags(batch)
    batch.set_defaults(func=cmd_run_batch)
    from eagleserve.train.cli import add_parser as add_train_draft

    add_train_draft(sub)
    add_client_parsers(sub)
    add_bench_parser(sub)
    return parser


def checked_server_args(ns: argparse.Namespace) -> ServerArgs | int:
    """The flags' ServerArgs, or exit code 2 once the first bad value is reported."""
    args = build_server_args(ns)
    if isinstance(args, ServerArgs):
        args = check_values(args) or args
    if isinstance(args, str):
        print(f"eagleserve: error: {args}", file=sys.stderr)
        return 2
    return args


def cmd_serve(ns: argparse.Namespace) -> int:
    args = checked_server_args(ns)
    if isinstance(args, int):
        return args
    if args.dp_size > 1:
        from eagleserve.server.dp import run_replicas

        return run_replicas(args)
    from eagleserve.server.launch import serve

    return asyncio.run(serve(args))


def cmd_run_batch(ns: argparse.Namespace) -> int:
    args = checked_server_args(ns)
    if isinstance(args, int):
        return args
    import logging

    from eagleserve.server.run_batch import run_batch

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    return asyncio.run(run_batch(args, ns.input_file, ns.output_file))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    raise SystemExit(main())

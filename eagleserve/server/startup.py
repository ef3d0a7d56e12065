"""Start-up checks of `eagleserve serve`, done before the model loads where they can be.

Invariant: every way start-up can fail ends in one line on stderr, `eagleserve: error: ...`,
and exit code 2 (the traceback only with `--log-level debug`). Order: the listening socket is
bound first (a port in use is reported in a second, not after the model loaded), then the model
and draft paths are checked, then the engine starts; SIGTERM/SIGINT while it loads stop it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import ssl
import sys
import time

from eagleserve.config import ServerArgs
from eagleserve.server.chat_template import read_chat_template
from eagleserve.server.engine_client import EngineClient, EngineStartupFailed

EXIT_CONFIG = 2
logger = logging.getLogger("eagleserve.server")


class StartupError(Exception):
    """A start-up failure, with the one line to print."""


def fail(message: str, detail: str = "", debug: bool = False) -> int:
    print(f"eagleserve: error: {message}", file=sys.stderr, flush=True)
    if debug and detail:
        print(detail, file=sys.stderr, flush=True)
    return EXIT_CONFIG


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (uvicorn listens on it once the engine is up;
    until then connections are refused)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise StartupError(f"--host {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is already in use (--port)") from None
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def check_paths(args: ServerArgs) -> None:
    """The model and draft paths exist and look like what the loader reads (no side effects:
    'default' and .gguf models are converted by the engine, not here); so does --chat-template
    (it renders a chat once the tokenizer is loaded: engine_client.py); the TLS files load."""
    from eagleserve.models.loader import resolve_draft_path, resolve_model_path

    if args.chat_template is not None:
        try:
            read_chat_template(args.chat_template)
        except (ValueError, OSError) as exc:
            raise StartupError(str(exc)) from None
    check_tls(args)
    try:
        if args.model.endswith(".gguf"):
            if not os.path.isfile(args.model):
                raise FileNotFoundError(f"GGUF file not found: {args.model}")
        elif args.model != "default":
            resolve_model_path(args.model)
        if args.speculative_algorithm and args.speculative_draft_model_path:
            resolve_draft_path(args.speculative_draft_model_path)
    except FileNotFoundError as exc:
        raise StartupError(str(exc)) from None


def check_tls(args: ServerArgs) -> None:
    """--ssl-certfile and --ssl-keyfile come together and load as a certificate and its key."""
    if args.ssl_certfile is None and args.ssl_keyfile is None:
        return
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        raise StartupError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            args.ssl_certfile, args.ssl_keyfile
        )
    except (OSError, ssl.SSLError) as exc:
        msg = f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: {exc}"
        raise StartupError(msg) from None


async def start_engine(client: EngineClient) -> bool:
    """Starts the engine; False when SIGTERM/SIGINT came first (the caller stops it). Logs the
    time from here to a ready engine (its process's imports included: the engine's own lines
    time its phases)."""
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(client.start())
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return False
    except EngineStartupFailed as exc:
        raise StartupError(f"the engine failed to start: {exc}") from exc
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
    logger.info("start-up: engine process ready in %.2f s", time.perf_counter() - t0)
    return True

"""Starting the engine and the HTTP server together (what `eagleserve serve` runs).

Lifecycle:
- SIGTERM / SIGINT, to the server alone or to its whole process group (the engine process
  ignores both; the server stops it last): drain. New requests get 503 (and /health 503) at
  once; requests in progress may finish for up to `$EAGLESERVE_DRAIN_TIMEOUT_S` seconds
  (default 20). Whatever still runs then is cut: a stream gets an error event and `[DONE]`, a
  plain request a 503. Then uvicorn shuts down with no request left, and the process exits 0.
  A second signal cuts at once; a third exits without waiting.
- The engine process dies (at any time, draining or not): requests get 503 for
  `ENGINE_DEATH_GRACE_S` (so clients and health checks see why), then the server exits with
  code 1 instead of serving 503s forever.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn

from eagleserve.config import ServerArgs
from eagleserve.server.api import create_app
from eagleserve.server.engine_client import EngineClient
from eagleserve.server.middleware import HttpStats
from eagleserve.server.request_log import REQUEST_LOGGER
from eagleserve.server.startup import StartupError, bind_socket, check_paths, fail, start_engine

DRAIN_TIMEOUT_ENV = "EAGLESERVE_DRAIN_TIMEOUT_S"
ENGINE_DEATH_GRACE_S = 5.0
CUT_GRACE_S = 5.0  # after the cut: time for handlers to send their error events
CUT_MESSAGE = "the server is shutting down: the request was cut (drain timeout or a second signal)"
logger = logging.getLogger("eagleserve.server")


class _Server(uvicorn.Server):
    """uvicorn's server, printing one line with the real address once it listens, draining on
    SIGTERM / SIGINT and exiting when the engine process died (see the module docstring)."""

    def __init__(
        self, config: uvicorn.Config, args: ServerArgs, client: EngineClient, http: HttpStats
    ) -> None:
        super().__init__(config)
        self.args = args
        self.client = client
        self.http = http
        self.signals = 0
        self.drain_deadline: float | None = None
        self.cut_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: it records the signal and re-raises it after the shutdown,
        # which makes a clean SIGTERM shutdown exit with -15 instead of 0.
        self.signals += 1
        now = time.monotonic()
        if self.signals == 1:
            timeout = float(os.environ.get(DRAIN_TIMEOUT_ENV, "20"))
            logger.warning("%s: draining (up to %.0f s)", signal.Signals(sig).name, timeout)
            self.drain_deadline = now + timeout
            self.client.draining = True
        elif self.signals == 2:
            self.drain_deadline = now
        else:
            self.should_exit = self.force_exit = True

    def busy(self) -> bool:
        """Requests in progress: read, tokenized, in the engine, or still being sent."""
        return self.http.active > 0 or bool(self.client.queues)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        died = self.client.died_at
        if died is not None and now - died > ENGINE_DEATH_GRACE_S:
            logger.error("the engine process is gone: shutting down")
            return True
        if self.drain_deadline is None:
            return False
        if not self.busy():
            return True
        if now < self.drain_deadline:
            return False
        if self.cut_at is None:
            self.cut_at = now
            cut = self.client.cut_all(CUT_MESSAGE)
            logger.warning("drain timeout: cutting %d request(s)", cut)
        return now > self.cut_at + CUT_GRACE_S

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if not self.started or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        ctx = self.client.max_context_len
        name = self.args.served_model_name or self.args.model
        scheme = "https" if self.args.ssl_certfile else "http"
        print(
            f"eagleserve ready: {scheme}://{host}:{port} (model={name}, context_length={ctx})",
            flush=True,
        )


async def serve(args: ServerArgs) -> int:
    """Runs the server until it is stopped; the process exit code (see the module docstring
    and startup.py: 2 for any start-up failure)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_requests:  # asked for by name: shown whatever --log-level says
        logging.getLogger(REQUEST_LOGGER).setLevel(logging.INFO)
    debug = args.log_level.lower() == "debug"
    client = EngineClient(args)
    try:
        sock = bind_socket(args.host, args.port)
        check_paths(args)
        if not await start_engine(client):
            print("eagleserve: stopped while starting", file=sys.stderr, flush=True)
            return 0  # stopping was asked for and done
    except StartupError as exc:
        cause = exc.__cause__
        return fail(str(exc), getattr(cause, "traceback", ""), debug)
    finally:
        if not client.healthy:
            await client.shutdown()
    try:
        http = HttpStats()
        config = uvicorn.Config(
            create_app(args, client, http),
            log_level=args.log_level.lower(),
            access_log=debug,
            timeout_graceful_shutdown=5,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
        )
        server = _Server(config, args, client, http)
        await server.serve(sockets=[sock])
        return 1 if client.died_at is not None else 0  # a drain, cut or not, is a clean exit
    finally:
        sock.close()
        await client.shutdown()

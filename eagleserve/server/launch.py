"""Starting the engine and the HTTP server together (what `eagleserve serve` runs).

Lifecycle:
- SIGTERM / SIGINT: drain. New requests get 503 (and /health 503) at once; in-flight requests
  may finish for up to `$EAGLESERVE_DRAIN_TIMEOUT_S` seconds (default 20), then uvicorn shuts
  down (what is still running is cancelled, which aborts it in the engine) and the process exits
  0. A second signal skips the drain. The signal is not re-raised after a graceful shutdown.
- The engine process dies: requests get 503 for `ENGINE_DEATH_GRACE_S` (so clients and health
  checks see why), then the server exits with code 1 instead of serving 503s forever.
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
from eagleserve.server.engine_client import EngineClient, EngineStartupFailed

DRAIN_TIMEOUT_ENV = "EAGLESERVE_DRAIN_TIMEOUT_S"
ENGINE_DEATH_GRACE_S = 5.0
logger = logging.getLogger("eagleserve.server")


class _Server(uvicorn.Server):
    """uvicorn's server, printing one line with the real address once it listens, draining on
    SIGTERM and exiting when the engine process died (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, args: ServerArgs, client: EngineClient) -> None:
        super().__init__(config)
        self.args = args
        self.client = client
        self.exit_code = 0
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: it records the signal and re-raises it after the shutdown,
        # which makes a clean SIGTERM shutdown exit with -15 instead of 0.
        if self.drain_deadline is None and not self.should_exit:
            timeout = float(os.environ.get(DRAIN_TIMEOUT_ENV, "20"))
            self.drain_deadline = time.monotonic() + timeout
            self.client.draining = True
        else:
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        died = self.client.died_at
        if died is not None and now - died > ENGINE_DEATH_GRACE_S:
            logger.error("the engine process is gone: shutting down")
            self.exit_code = 1
            return True
        if self.drain_deadline is not None:
            # client.queues holds every request the server has not finished with yet.
            return not self.client.queues or now > self.drain_deadline
        return False

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if not self.started or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        ctx = self.client.max_context_len
        name = self.args.served_model_name or self.args.model
        print(
            f"eagleserve ready: http://{host}:{port} (model={name}, max_context_len={ctx})",
            flush=True,
        )


async def serve(args: ServerArgs) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    client = EngineClient(args)
    try:
        try:
            await client.start()
        except EngineStartupFailed as exc:
            print(f"eagleserve: the engine failed to start: {exc}", file=sys.stderr, flush=True)
            return 1
        app = create_app(args, client)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.log_level.lower() == "debug",
            timeout_graceful_shutdown=5,
        )
        server = _Server(config, args, client)
        await server.serve()
        return server.exit_code
    finally:
        await client.shutdown()

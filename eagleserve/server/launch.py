"""Starting the engine and the HTTP server together (what `eagleserve serve` runs)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import uvicorn

from eagleserve.config import ServerArgs
from eagleserve.server.api import create_app
from eagleserve.server.engine_client import EngineClient, EngineStartupFailed


class _Server(uvicorn.Server):
    """uvicorn's server, printing one line with the real address once it listens."""

    def __init__(self, config: uvicorn.Config, args: ServerArgs, client: EngineClient) -> None:
        super().__init__(config)
        self.args = args
        self.client = client

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
        await _Server(config, args, client).serve()
        return 0
    finally:
        await client.shutdown()

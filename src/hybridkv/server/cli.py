"""Arguments and entry point of ``hybridkv serve``.

Only the standard library is imported here; the engine, FastAPI and uvicorn load when
``serve_main`` runs, so building the ``hybridkv`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from hybridkv.engine.cli import add_engine_arguments, engine_config


def add_parser(sub: Any) -> None:
    """The ``serve`` subcommand of ``hybridkv``."""
    p = sub.add_parser("serve", help="serve the embedded Gemma 3 270M over an OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=serve_main)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hybridkv serve`` options to ``parser``; unset engine options keep ``EngineConfig``'s defaults."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one "
                                                               "(default: %(default)s)")
    parser.add_argument("--model-name", default="gemma-3-270m",
                        help="the model id clients send and /v1/models lists (default: %(default)s)")
    add_engine_arguments(parser)


def serve_main(args: argparse.Namespace) -> int:
    """Load the embedded model and serve it until SIGINT/SIGTERM; in-flight requests finish first.

    Returns 0 after a graceful shutdown, 2 for a bad engine configuration.
    """
    import uvicorn

    from hybridkv.engine.engine import LLMEngine
    from hybridkv.errors import InvalidInputError
    from hybridkv.server.app import build_app
    from hybridkv.server.async_engine import AsyncEngine

    try:
        engine = LLMEngine.from_package(engine_config(args))
    except InvalidInputError as exc:
        print(f"hybridkv serve: {exc}", file=sys.stderr)
        return 2
    async_engine = AsyncEngine(engine)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1]
                host = f"[{args.host}]" if ":" in args.host else args.host
                print(f"hybridkv serve: {args.model_name} ready at http://{host}:{port}/v1", flush=True)

    server = Server(uvicorn.Config(build_app(async_engine, args.model_name), host=args.host, port=args.port))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then restores the previous handlers and re-raises the
    # signal; a no-op SIGTERM handler and catching KeyboardInterrupt make that a normal return.
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        async_engine.shutdown(graceful=False)  # returns at once when the app's shutdown already drained it
    return 0

"""Arguments and entry point of ``hybridkv serve``.

Only the standard library is imported here; the engine, FastAPI and uvicorn load when
``serve_main`` runs. The port is bound before the model loads; SIGTERM drains requests in flight
for ``--shutdown-timeout`` seconds. See docs/ENGINE.md, "The server's engine thread".
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from typing import Any

from hybridkv.cli_args import input_path_arg, listening_socket, port_arg
from hybridkv.engine.cli import add_engine_arguments
from hybridkv.sizes import size_arg

logger = logging.getLogger("hybridkv.server")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_parser(sub: Any) -> None:
    """The ``serve`` subcommand of ``hybridkv``."""
    p = sub.add_parser("serve", help="serve the embedded Gemma 3 270M over an OpenAI-compatible HTTP API",
                       description="Serve Gemma 3 270M on hybridkv's paged cache over an OpenAI-compatible HTTP API "
                                   "(/v1/completions, /v1/chat/completions, /v1/models, /metrics, /health).")
    add_serve_arguments(p)
    p.set_defaults(func=serve_main)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hybridkv serve`` options to ``parser``; unset engine options keep ``EngineConfig``'s defaults."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_arg, default=8000, help="port to listen on; 0 picks a free one "
                                                               "(default: %(default)s)")
    parser.add_argument("--model-name", default=None,
                        help="the model id clients send and /v1/models lists (default: the --model name)")
    parser.add_argument("--chat-template", type=input_path_arg, default=None, metavar="FILE",
                        help="Jinja chat template for /v1/chat/completions (default: the GGUF's own, else "
                             "Gemma's <start_of_turn>/<end_of_turn> turns)")
    parser.add_argument("--max-request-bytes", type=size_arg, default=8 << 20, metavar="BYTES",
                        help="larger request bodies get 413 (default: 8MiB)")
    parser.add_argument("--no-bos-for-token-prompts", dest="bos_for_token_prompts", action="store_false",
                        help="send token-id prompts as given; by default <bos> is put before one that lacks it "
                             "(it is not echoed)")
    parser.add_argument("--metrics-names", choices=("vllm", "hybridkv"), default="vllm",
                        help="/metrics names: vllm (vLLM's own, vllm:num_requests_waiting, ...: dashboards and "
                             "routers built for vLLM work unchanged) or hybridkv (hybridkv_num_requests_waiting, "
                             "...); metrics vLLM has no name for are hybridkv_* either way (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM/Ctrl-C, how long requests in flight may finish before they are ended "
                             "with an error (default: %(default)s)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="how much the server logs (default: %(default)s)")
    parser.add_argument("--access-log-metrics", action="store_true",
                        help="also log GET /metrics and /health in the access log (off by default: scrapers "
                             "would flood it)")
    add_engine_arguments(parser)


class _QuietProbes(logging.Filter):
    """Drops uvicorn access-log records of /metrics and /health."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else ""
        return not (isinstance(path, str) and path.split("?", 1)[0] in ("/metrics", "/health"))


def serve_main(args: argparse.Namespace) -> int:
    """Load the embedded model and serve it until SIGINT/SIGTERM.

    Returns 0 after a shutdown, 2 for a bad option (port in use, bad engine configuration or chat template).
    """
    from hybridkv.errors import InvalidInputError

    start = time.perf_counter()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.access_log_metrics:
        logging.getLogger("uvicorn.access").addFilter(_QuietProbes())
    if args.shutdown_timeout < 0:
        print("hybridkv serve: --shutdown-timeout must be >= 0", file=sys.stderr)
        return 2
    try:
        sock = listening_socket(args.host, args.port)
        port = sock.getsockname()[1]
        logger.info("port %d is free; importing torch and the server", port)
        return _serve(args, sock, start)
    except InvalidInputError as exc:
        print(f"hybridkv serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace, sock: socket.socket, start: float) -> int:
    mark = time.perf_counter()
    import uvicorn

    from hybridkv.engine.engine import LLMEngine
    from hybridkv.engine.preflight import checked_engine_config
    from hybridkv.server.app import ServerOptions, build_app, build_context
    from hybridkv.server.async_engine import AsyncEngine

    logger.info("imported in %.1f s", time.perf_counter() - mark)
    config = checked_engine_config(args)  # what the options alone reveal, before the model loads
    if args.model_name is None:
        args.model_name = config.model
    engine = LLMEngine.from_package(config)
    async_engine = AsyncEngine(engine, args.model_name, metrics_names=args.metrics_names)
    options = ServerOptions(chat_template=args.chat_template, max_request_bytes=args.max_request_bytes,
                            bos_for_token_prompts=args.bos_for_token_prompts)
    try:
        context = build_context(async_engine, args.model_name, options)
    except BaseException:
        async_engine.shutdown(graceful=False)
        raise
    logger.info("chat template: %s", context.chat_template.origin)
    logger.info("serving as model %r; bodies over %d bytes get 413; a shutdown drains for up to %g s",
                args.model_name, args.max_request_bytes, args.shutdown_timeout)
    app = build_app(async_engine, args.model_name, options, context)
    timeout = args.shutdown_timeout
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info("listening on http://%s:%d (ready %.1f s after start)", host, port,
                            time.perf_counter() - start)
                print(f"hybridkv serve: {args.model_name} ready at http://{host}:{port}/v1", flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            async_engine.begin_drain(timeout)  # streams still open after the timeout end with an error event
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=port, log_config=None, log_level=args.log_level,
                            timeout_graceful_shutdown=timeout + 5)
    server = Server(config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then restores the previous handlers and re-raises the
    # signal; a no-op SIGTERM handler and catching KeyboardInterrupt make that a normal return.
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        async_engine.shutdown(graceful=False)  # returns at once when the app's shutdown already drained it
        logger.info("stopped")
    return 0

"""Arguments and entry point of ``hybridkv route`` (the KV-aware router).

Only the standard library is imported at module level; FastAPI, uvicorn, httpx and pyzmq load when
the router runs. ``main(argv)`` runs it standalone; ``add_parser(sub)`` registers it as a
subcommand of ``hybridkv``. See docs/CLUSTER.md, "Running N replicas, a router and Redis".
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from hybridkv.cli_args import Parser, listening_socket, port_arg
from hybridkv.errors import InvalidInputError

_BACKEND_HELP = (
    "a backend: URL[,events=ZMQ_ENDPOINT][,replay=ZMQ_ENDPOINT][,hash=SCHEME][,groups=N]; repeat for each. "
    "events/replay: where it publishes KV events (vLLM's format); hash: vllm (sha256, vLLM's default), "
    "vllm:xxhash:SEED, hybridkv or hybridkv:xxh3_128 (default: --hash); groups: its KV-cache group count "
    "(its layout is learned from the store events; with groups, predictions wait until every group was seen)"
)


def parse_backend(spec: str, default_hash: str = "vllm") -> Any:
    """A ``BackendSpec`` from ``URL[,key=value...]``; ``InvalidInputError`` naming the bad part."""
    from hybridkv.cluster.router import BackendSpec

    url, *options = [part.strip() for part in spec.split(",")]
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise InvalidInputError(f"--backend {spec!r}: the first part must be an http:// or https:// URL")
    fields: dict[str, Any] = {"hash_scheme": default_hash}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not value:
            raise InvalidInputError(f"--backend {spec!r}: {option!r} is not key=value")
        if key in ("events", "replay"):
            if not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidInputError(f"--backend {spec!r}: {key} must be a ZMQ endpoint like tcp://HOST:PORT")
            fields[key] = value
        elif key == "hash":
            fields["hash_scheme"] = value
        elif key == "groups":
            if not value.isdigit() or int(value) < 1:
                raise InvalidInputError(f"--backend {spec!r}: groups must be a positive integer, got {value!r}")
            fields["groups"] = int(value)
        else:
            raise InvalidInputError(f"--backend {spec!r}: unknown option {key!r} (events, replay, hash, groups)")
    if "replay" in fields and "events" not in fields:
        raise InvalidInputError(f"--backend {spec!r}: a replay endpoint needs an events endpoint")
    return BackendSpec(url.rstrip("/"), **fields)


def parse_medium_weights(specs: list[str]) -> dict[str, float]:
    """``MEDIUM=FRACTION`` options as a map; ``InvalidInputError`` naming the bad one."""
    out: dict[str, float] = {}
    for spec in specs:
        medium, sep, value = spec.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not medium or not 0 <= weight <= 1:
            raise InvalidInputError(f"--medium-weight {spec!r}: expected MEDIUM=FRACTION with a fraction in [0, 1], "
                                    f"e.g. CPU=0.8")
        out[medium] = weight
    return out


def add_locality_arguments(parser: Any, what: str) -> None:
    """``hybrid_exact``'s options (``--balance``, ``--slack``, ``--miss-weight``, ``--junction-weight``,
    ``--home-tokens``) on
    ``parser`` (a parser or an argument group); ``what``: "backend" or "replica"."""
    from hybridkv.cluster.routing import BALANCE, HOME_TOKENS, JUNCTION_WEIGHT, MISS_WEIGHT, SLACK

    parser.add_argument("--balance", type=float, default=BALANCE, metavar="FACTOR",
                        help=f"hybrid_exact: a {what} is overloaded above FACTOR times the mean requests in flight "
                             "plus --slack; until then a request stays where its prefix is (default: %(default)s)")
    parser.add_argument("--slack", type=int, default=SLACK, metavar="REQUESTS",
                        help=f"hybrid_exact: requests in flight a {what} may have above the balance bound "
                             "(default: %(default)s)")
    parser.add_argument("--miss-weight", type=float, default=MISS_WEIGHT, metavar="FACTOR",
                        help=f"hybrid_exact: what a prompt token the request must compute weighs against one the "
                             f"{what} has queued to prefill ahead of it (default: %(default)s)")
    parser.add_argument("--junction-weight", type=float, default=JUNCTION_WEIGHT, metavar="FRACTION",
                        help=f"hybrid_exact: what a token of the prompt's full-attention chain a {what}'s tiers "
                             "hold past its hit (a shared-prefix junction, whose window the request then leaves "
                             "there) is worth against a hit token (default: %(default)s)")
    parser.add_argument("--home-tokens", type=int, default=HOME_TOKENS, metavar="TOKENS",
                        help=f"hybrid_exact: between equal costs a prefix goes to its home {what} on a "
                             "consistent-hash ring of its first TOKENS tokens (default: %(default)s)")


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hybridkv route`` options."""
    from hybridkv.cluster.routing import POLICIES

    parser.add_argument("--backend", action="append", required=True, metavar="SPEC", help=_BACKEND_HELP)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port_arg, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--policy", default="hybrid_exact", choices=POLICIES,
                        help="how to choose a backend (default: %(default)s)")
    parser.add_argument("--hash", default="vllm", help="the backends' block-hash scheme unless a --backend "
                                                       "says otherwise (default: %(default)s)")
    parser.add_argument("--load-weight", type=float, default=0.25, metavar="FRACTION",
                        help="what one queued request is worth against a predicted hit, as a fraction of the "
                             "request's prompt (default: %(default)s)")
    parser.add_argument("--kv-weight", type=float, default=0.0, metavar="FRACTION",
                        help="what a full KV cache is worth against a predicted hit, as a fraction of the "
                             "request's prompt (default: %(default)s)")
    add_locality_arguments(parser, "backend")
    parser.add_argument("--metrics-interval", type=float, default=0.5,
                        help="seconds between scrapes of each backend's /metrics (default: %(default)s)")
    parser.add_argument("--medium-weight", action="append", default=[], metavar="MEDIUM=FRACTION",
                        help="what a predicted hit token on MEDIUM is worth against one on the device, 0..1 "
                             "(its load costs time; defaults: CPU=0.8, STORAGE=0.5, any other 0.5; repeatable)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                        help="how much the router logs; debug: one line per routed request (the backend chosen, "
                             "why, each backend's predicted hit, cost and queue) (default: %(default)s)")
    parser.add_argument("--shared-medium", action="append", default=[], metavar="MEDIUM",
                        help="a medium every backend reads (a shared tier such as Redis); its events, from any "
                             "backend, extend every backend's predicted hit")


def add_parser(sub: Any) -> None:
    """The ``route`` subcommand of ``hybridkv``."""
    p = sub.add_parser("route", help="a KV-aware OpenAI-compatible router in front of several backends",
                       description="Route OpenAI-compatible requests to the backend that holds most of their "
                                   "prompt in its KV cache (learned from the backends' KV events), against load.")
    add_route_arguments(p)
    p.set_defaults(func=route_main)


def route_main(args: argparse.Namespace) -> int:
    """Run the router until SIGINT/SIGTERM. Returns 0, or 2 for bad arguments."""
    try:
        import uvicorn

        from hybridkv.cluster.hashes import scheme_named
        from hybridkv.cluster.router import ClusterRouter, RouterConfig, build_app
        from hybridkv.cluster.routing import Policy
    except ImportError as exc:
        print(f"hybridkv route: needs the cluster extra (pip install 'hybridkv[cluster]'): {exc}", file=sys.stderr)
        return 2
    try:
        backends = [parse_backend(spec, args.hash) for spec in args.backend]
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"--backend: the same URL given twice ({', '.join(names)})")
        for b in backends:
            scheme_named(b.hash_scheme)
        weights = parse_medium_weights(args.medium_weight)
        Policy(args.policy, load_weight=args.load_weight, kv_weight=args.kv_weight, medium_weights=weights,
               balance=args.balance, slack=args.slack, home_tokens=args.home_tokens, miss_weight=args.miss_weight,
               junction_weight=args.junction_weight)
        if args.metrics_interval <= 0:
            raise InvalidInputError(f"--metrics-interval must be positive, got {args.metrics_interval}")
        config = RouterConfig(backends, policy=args.policy, load_weight=args.load_weight, kv_weight=args.kv_weight,
                              metrics_interval=args.metrics_interval, shared_media=args.shared_medium,
                              medium_weights=weights, balance=args.balance, slack=args.slack,
                              home_tokens=args.home_tokens, miss_weight=args.miss_weight,
                              junction_weight=args.junction_weight)
        sock = listening_socket(args.host, args.port)  # a busy port fails here, before "listening" is printed
    except InvalidInputError as exc:
        print(f"hybridkv route: {exc}", file=sys.stderr)
        return 2
    try:
        router = ClusterRouter(config)
    except InvalidInputError as exc:
        sock.close()
        print(f"hybridkv route: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hybridkv").setLevel(args.log_level.upper())  # not the HTTP clients' debug chatter
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"hybridkv route: {len(backends)} backends, policy {args.policy}, listening on "
          f"http://{host}:{sock.getsockname()[1]}/v1", flush=True)
    try:
        server = uvicorn.Config(build_app(router), host=args.host, port=sock.getsockname()[1], log_level="warning")
        uvicorn.Server(server).run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hybridkv route`` as a program of its own."""
    parser = Parser(prog="hybridkv route", description=__doc__.split("\n\n")[0])
    add_route_arguments(parser)
    try:
        args = parser.parse_args(argv)
        return route_main(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

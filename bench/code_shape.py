"""The shape of the code: lines per package, long functions, import circles, long module docstrings.

    python bench/code_shape.py [--src src/hybridkv] [--long 60] [--json]

Counts what a maintainer pays for (issue 25's before/after figures): non-blank lines per package,
functions longer than ``--long`` lines, module docstrings over 12 lines, and the import circles:
strongly connected components of the graph of imports between packages (``core``, ``sim``, ...)
and between modules, counting imports made at run time inside functions too (those are circles
hidden from a reader, not removed). ``TYPE_CHECKING`` imports are left out: they never run.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections import defaultdict
from pathlib import Path


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(path: Path, src: Path) -> str:
    """The subpackage a file belongs to (``core``, ``sim``, ...); ``(top)`` for the package's own modules."""
    parts = path.relative_to(src).parts
    return parts[0] if len(parts) > 1 else "(top)"


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules ``module`` imports (absolute names), skipping ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                head = ".".join(base[: len(base) - node.level + 1])
                target = f"{head}.{node.module}" if node.module else head
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    comp.append(n)
                    if n == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def measure(src: Path, long_lines: int) -> dict[str, object]:
    files = sorted(src.rglob("*.py"))
    modules = {_module_name(f, src): f for f in files}
    lines: dict[str, int] = defaultdict(int)
    long_functions: list[tuple[str, int]] = []
    long_docstrings: list[tuple[str, int]] = []
    module_graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        text = path.read_text()
        lines[_package(path, src)] += sum(1 for line in text.splitlines() if line.strip())
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False)
        if doc and doc.count("\n") + 1 > 12:
            long_docstrings.append((name, doc.count("\n") + 1))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > long_lines:
                    long_functions.append((f"{name}:{node.name}", n))
        for target in _imports(tree, name, path.name == "__init__.py"):
            if target in modules and target != name:
                module_graph[name].add(target)
    package_graph: dict[str, set[str]] = defaultdict(set)
    for a, targets in module_graph.items():
        pa = _package(modules[a], src)
        for b in targets:
            pb = _package(modules[b], src)
            if pa != pb and "(top)" not in (pa, pb):
                package_graph[pa].add(pb)
        package_graph.setdefault(pa, set())
    return {
        "lines_per_package": dict(sorted(lines.items())),
        "lines_total": sum(lines.values()),
        "functions_over_limit": sorted(long_functions, key=lambda x: -x[1]),
        "module_docstrings_over_12_lines": sorted(long_docstrings, key=lambda x: -x[1]),
        "package_circles": _components(package_graph),
        "module_circles": _components(module_graph),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent / "src" / "hybridkv")
    parser.add_argument("--long", type=int, default=60, help="a function longer than this many lines counts (60)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    m = measure(args.src, args.long)
    if args.json:
        print(json.dumps(m, indent=1))
        return
    print("non-blank lines per package:")
    for package, n in m["lines_per_package"].items():  # type: ignore[attr-defined]
        print(f"  {package:12s} {n:6d}")
    print(f"  {'total':12s} {m['lines_total']:6d}")
    longs = m["functions_over_limit"]
    print(f"functions over {args.long} lines: {len(longs)}")  # type: ignore[arg-type]
    for name, n in longs:  # type: ignore[attr-defined]
        print(f"  {n:4d}  {name}")
    docs = m["module_docstrings_over_12_lines"]
    print(f"module docstrings over 12 lines: {len(docs)}")  # type: ignore[arg-type]
    for name, n in docs:  # type: ignore[attr-defined]
        print(f"  {n:4d}  {name}")
    print(f"import circles between packages: {len(m['package_circles'])}")  # type: ignore[arg-type]
    for comp in m["package_circles"]:  # type: ignore[attr-defined]
        print("  " + " <-> ".join(comp))
    print(f"import circles between modules: {len(m['module_circles'])}")  # type: ignore[arg-type]
    for comp in m["module_circles"]:  # type: ignore[attr-defined]
        print(f"  ({len(comp)} modules) " + ", ".join(c.removeprefix('hybridkv.') for c in comp))


if __name__ == "__main__":
    main()

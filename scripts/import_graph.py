"""The imports between tgraph's own files, read from the code with :mod:`ast`, as the list in
docs/ARCHITECTURE.md's "Import graph" section.

    python scripts/import_graph.py            # print the list
    python scripts/import_graph.py --write    # rewrite the list in docs/ARCHITECTURE.md

One line per file of ``tgraph/`` (``__init__.py``, ``decode/``, ``toy/`` and ``integrations/``
apart): ``* `layers/follow -> {grads, layers/captured, pool}` (`rng`)``, the files it imports
when it is imported, then in parentheses those it imports lazily, inside a function. A file
that imports no other file of tgraph reads ``none (torch only)``. tests/test_architecture.py
fails when the doc's list differs from this one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tgraph"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
APART = ("decode", "toy", "integrations")  # listed in their own packages' docstrings


@dataclass
class Imports:
    """One file's imports of other tgraph files, by name (``layers/manager``, ``pool``)."""

    top: set[str] = field(default_factory=set)  # at import time (module level)
    lazy: set[str] = field(default_factory=set)  # inside a function only


def module_name(path: Path) -> str:
    """``tgraph/layers/manager.py`` -> ``layers/manager``; a package's ``__init__.py`` -> its
    folder (``decode``)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return "/".join(parts)


def _files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _target(dotted: str, known: dict[str, Path]) -> str | None:
    """The tgraph file a dotted module name is (``tgraph.layers.replay`` -> ``layers/replay``)."""
    parts = dotted.split(".")
    if parts[0] != "tgraph" or len(parts) == 1:
        return None
    name = "/".join(parts[1:])
    return name if name in known else None


def _imported(node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {t for a in node.names if (t := _target(a.name, known))}
    if node.level or node.module is None:  # relative imports: tgraph has none
        raise ValueError(f"relative import at line {node.lineno}: spell it tgraph.<module>")
    found = set()
    base = _target(node.module, known)
    for a in node.names:  # from tgraph.layers import replay: the file layers/replay
        sub = _target(f"{node.module}.{a.name}", known)
        if sub is not None:
            found.add(sub)
        elif base is not None:
            found.add(base)
    return found


def file_imports(path: Path, known: dict[str, Path]) -> Imports:
    """A file's imports of other tgraph files: module level (under ``if``/``try`` too), or
    inside a function (lazy)."""
    out = Imports()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (out.lazy if in_function else out.top).update(_imported(child, known))
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    me = module_name(path)
    out.top.discard(me)
    out.lazy -= out.top | {me}
    return out


def import_graph() -> dict[str, Imports]:
    """Every tgraph file (packages' ``__init__`` included) and its imports of the others."""
    known = _files()
    return {name: file_imports(path, known) for name, path in known.items()}


def listed(name: str) -> bool:
    """Whether the doc's list has a line for ``name``."""
    return PACKAGE.joinpath(*name.split("/")).with_suffix(".py").exists() and (
        name.split("/")[0] not in APART
    )


def render(graph: dict[str, Imports]) -> list[str]:
    """The doc's list, one line per listed file, sorted by name."""
    lines = []
    for name in sorted(n for n in graph if listed(n)):
        imp = graph[name]
        line = f"* `{name} -> {{{', '.join(sorted(imp.top))}}}`" if imp.top else f"* `{name}`:"
        if imp.lazy:
            line += " (" + ", ".join(f"`{n}`" for n in sorted(imp.lazy)) + ")"
        elif not imp.top:
            line += " none (torch only)"
        lines.append(line)
    return lines


def doc_list(text: str) -> tuple[int, int]:
    """Where the list sits in the doc's text, (start, end) character offsets: the first run of
    lines starting with ``* ``` after the "Import graph" heading."""
    start = text.index("\n* `", text.index("## Import graph")) + 1
    end = start
    while text.startswith("* `", end):
        end = text.index("\n", end) + 1
    return start, end


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite the list in {DOC.name}")
    a = p.parse_args(argv)
    lines = render(import_graph())
    if not a.write:
        print("\n".join(lines))
        return 0
    text = DOC.read_text()
    start, end = doc_list(text)
    DOC.write_text(text[:start] + "\n".join(lines) + "\n" + text[end:])
    print(f"wrote {len(lines)} lines to {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

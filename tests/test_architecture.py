"""docs/ARCHITECTURE.md against the code: its import-graph list is the generated one
(scripts/import_graph.py), no import cycle and no arrow from a lower floor up, and its "One
forward replay, traced" figures are what a trace of a forward replay measures."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

import tgraph
from tgraph.toy.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
GROUND = (  # the files every floor stands on (docs/ARCHITECTURE.md, "Import graph")
    "backend",
    "emulated",
    "pool",
    "signature",
    "baked",
    "snapshot",
    "guards",
    "memory",
    "rng",
    "errors",
)
FORWARD_REPLAY_BUDGET = 5  # distinct tgraph files one forward replay may cross


@pytest.fixture(scope="module")
def import_graph():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return import_graph


def test_doc_import_graph_is_the_generated_one(import_graph):
    text = DOC.read_text()
    start, end = import_graph.doc_list(text)
    doc = text[start:end].splitlines()
    generated = import_graph.render(import_graph.import_graph())
    assert doc == generated, (
        "docs/ARCHITECTURE.md's import graph differs from the code: run "
        "`python scripts/import_graph.py --write`"
    )


def test_doc_names_what_the_package_init_imports(import_graph):
    text = DOC.read_text()
    start = text.index("`tgraph/__init__.py` imports the public names from")
    sentence = text[start : text.index("and defines `reset()`", start)]
    named = set(re.findall(r"`([\w/]+)`", sentence)) - {"tgraph/__init__.py", "reset"}
    assert named == import_graph.import_graph()[""].top


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` (as a path that ends where it starts), or None."""
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(edges.get(node, ())):
            found = walk(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(edges):
        found = walk(node, [])
        if found:
            return found
    return None


def test_no_import_cycle(import_graph):
    graph = import_graph.import_graph()
    # at import time; and with the lazy imports too (a lazy import must not hide a cycle)
    assert _cycle({n: i.top for n, i in graph.items()}) is None
    assert _cycle({n: i.top | i.lazy for n, i in graph.items()}) is None


def test_planted_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_arrow_back_up(import_graph):
    """layers/ never imports step/; the ground files import neither (lazily neither)."""
    graph = import_graph.import_graph()
    up = []
    for name, imp in graph.items():
        for target in imp.top | imp.lazy:
            floor = target.split("/")[0]
            if name.startswith("layers/") and floor == "step":
                up.append(f"{name} -> {target}")
            if name in GROUND and floor in ("layers", "step"):
                up.append(f"{name} -> {target}")
    assert up == [], "an arrow up: " + ", ".join(up)
    assert set(GROUND) <= set(graph)  # the ground files are still where this test looks


# -- one forward replay, traced ---------------------------------------------------------------

_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # inlined from 3.12


def trace_forward_replay() -> list[str]:
    """The tgraph files (``toy/`` apart) a forward replay enters, in order, one entry per
    change of file: a one-layer toy GPT on the emulated backend, ``sys.setprofile``, call
    events only (comprehensions' frames left out: Python 3.12 inlines them)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    tgraph.enable(model, backend="emulated")
    x, y = (torch.randint(0, 64, (2, 16)) for _ in range(2))
    model(x, y)[1].backward()  # the recorded iteration
    tgraph.create_graphs()
    for _ in range(3):  # past the shadow verifier's first replays (tgraph.verification)
        model(x, y)[1].backward()
    root = os.path.dirname(tgraph.__file__) + os.sep
    files: list[str] = []

    def on_event(frame, event, arg) -> None:
        code = frame.f_code
        if event != "call" or code.co_name in _COMPREHENSIONS:
            return
        if code.co_filename.startswith(root):
            rel = code.co_filename[len(root) :].replace(os.sep, "/")
            if not rel.startswith("toy/") and (not files or files[-1] != rel):
                files.append(rel)

    sys.setprofile(on_event)
    try:
        loss = model(x, y)[1]
    finally:
        sys.setprofile(None)
    loss.backward()
    return files


def _doc_trace_section() -> str:
    text = DOC.read_text()
    start = text.index("## One forward replay, traced")
    return text[start : text.index("\n## ", start + 1)]


def test_doc_forward_replay_figures_are_measured():
    """The section's file count, its numbered list of files and its count of file changes
    are what the trace measures."""
    files = trace_forward_replay()
    crossed = set(files)
    section = _doc_trace_section()
    n_files = int(re.search(r"crosses\s+\*\*(\d+) files\*\*\s+on a forward replay", section)[1])
    changes = int(re.search(r"changes\s+file\s+(\d+)\s+times", section)[1])
    items = re.findall(r"^\d+\. (.*)$", section, re.M)  # each item's first line
    named = [set(re.findall(r"`([\w/]+\.py)`", item)) for item in items]
    assert (len(crossed), len(files) - 1) == (n_files, changes), files
    assert len(items) == n_files
    for names in named:  # each item names a file crossed (CUDA or emulated for the graph's)
        assert names & crossed, (names, files)
    assert crossed <= set().union(*named), files
    assert "layers/capture.py" not in crossed


def test_forward_replay_crosses_at_most_the_budget_of_files():
    crossed = set(trace_forward_replay())
    assert len(crossed) <= FORWARD_REPLAY_BUDGET, sorted(crossed)

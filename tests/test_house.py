"""The house's cleanups, kept: the README's tour names every library file, no test module imports
another, no module is a deprecation shim or a bare re-export, tests read graph state through the
public API, the docs cite scripts that exist, and no generated output is committed.

Each check is a function of the text it reads, so a planted case shows what it reports."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "tgraph"
TESTS = ROOT / "tests"


# -- the README's tour lists every library file ------------------------------------------------


def _tour(readme: str) -> str:
    start = readme.index("## Tour of the code")
    return readme[start : readme.index("\n## ", start + 1)]


def library_files() -> list[str]:
    """Every file of the library, as ``tgraph/...`` paths."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in LIBRARY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def missing_from_tour(tour: str, files: list[str]) -> list[str]:
    """The ``files`` the tour names nowhere. A file is named by its path (```tgraph/x/y.py```),
    or by its name in the row of its directory (```tgraph/x/``` ... ```y.py```); a package's
    ``__init__.py`` by any row of its package (the top one's by its path)."""
    rows = [set(re.findall(r"`([^`]+)`", line)) for line in tour.splitlines()]
    spans = set().union(*rows)
    missing = []
    for path in files:
        folder, name = path.rsplit("/", 1)
        if path in spans:
            continue
        if any(f"{folder}/" in row and name in row for row in rows):
            continue
        if name == "__init__.py" and folder != "tgraph":
            if any(s.startswith(f"{folder}/") for s in spans):
                continue
        missing.append(path)
    return missing


def test_readme_tour_lists_every_library_file():
    missing = missing_from_tour(_tour((ROOT / "README.md").read_text()), library_files())
    assert not missing, (
        f"README.md's 'Tour of the code' does not name {missing}: add each to the row of the "
        "mechanism it holds"
    )


def test_tour_check_names_the_file_a_row_lost():
    tour = "| `tgraph/a.py` | one |\n| `tgraph/d/` | `b.py` and `c.py` |\n"
    files = ["tgraph/a.py", "tgraph/d/__init__.py", "tgraph/d/b.py", "tgraph/d/c.py"]
    assert missing_from_tour(tour, files) == []
    assert missing_from_tour(tour.replace(" and `c.py`", ""), files) == ["tgraph/d/c.py"]
    assert missing_from_tour(tour, [*files, "tgraph/__init__.py"]) == ["tgraph/__init__.py"]


# -- no test module imports another ------------------------------------------------------------


def imported_test_modules(source: str) -> list[str]:
    """The ``test_*`` modules ``source`` imports (``import test_x``, ``from test_x import``,
    ``from tests.test_x import``), each as ``line: module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """Shared helpers live in helper modules (``tests/decode_models.py``, ...): a test module
    imported by another runs its collection-time code twice and ties two files' fixtures."""
    offenders = {
        p.name: found
        for p in sorted(TESTS.glob("test_*.py"))
        if (found := imported_test_modules(p.read_text()))
    }
    assert not offenders, f"move what they share into a helper module (not test_*.py): {offenders}"


def test_test_import_check_finds_each_spelling():
    source = (
        "import test_a\nfrom test_b import x\nfrom tests.test_c import y\nfrom helpers import z\n"
    )
    assert imported_test_modules(source) == ["1: test_a", "2: test_b", "3: tests.test_c"]


# -- no deprecation shim, no bare re-export ----------------------------------------------------


def shim_reasons(source: str, is_package_init: bool) -> list[str]:
    """Why a library module's ``source`` reads as a shim: it warns of a deprecation, or
    (outside a package's ``__init__.py``) its body is only imports, a docstring and
    ``__all__``."""
    reasons = []
    if re.search(r"\b(Pending)?DeprecationWarning\b|\bFutureWarning\b", source):
        reasons.append("warns of a deprecation")
    body = ast.parse(source).body
    only_imports = all(
        isinstance(n, (ast.Import, ast.ImportFrom))
        or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        or (isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["__all__"])
        for n in body
    )
    if only_imports and not is_package_init and body:
        reasons.append("only re-exports what other modules define")
    return reasons


def test_no_module_is_a_deprecation_shim():
    """Old names are not kept alive by aliases or warnings: callers are updated instead."""
    shims = {
        path: why
        for path in library_files()
        if path.endswith(".py")
        and (why := shim_reasons((ROOT / path).read_text(), path.endswith("/__init__.py")))
    }
    assert not shims, shims


def test_shim_check_finds_a_warning_and_a_re_export():
    warned = "import warnings\nwarnings.warn('old', DeprecationWarning)\n"
    re_export = '"""Moved."""\nfrom tgraph.step.optimizer_graph import OptimizerGraph\n'
    assert shim_reasons(warned, False) == ["warns of a deprecation"]
    assert shim_reasons(re_export, False) == ["only re-exports what other modules define"]
    assert shim_reasons(re_export, True) == []  # a package gathers its public names
    assert shim_reasons("def f():\n    return 1\n", False) == []


# -- tests read graph state through the public API ---------------------------------------------

# The per-layer manager's state that has no public reader, and why a test reads it.
MANAGER_READS_ALLOWED = {
    "units": "the captured units (capture results, ledgers) that a test inspects",
    "all_runners": "the runners and their recorded samples",
    "modules": "every enabled module, for tests/conftest.py to disable after each test",
    "captured": "whether create_graphs left graphs; capture_report() is empty either way",
}


def manager_reads(source: str) -> list[str]:
    """Each use of ``_manager`` in ``source`` outside :data:`MANAGER_READS_ALLOWED` (an import of
    the name is no use), as ``line: text``."""
    found = []
    for i, line in enumerate(source.splitlines(), 1):
        if re.match(r"\s*from tgraph\.layers\.manager import .*\b_manager\b", line):
            continue
        for m in re.finditer(r"\b_manager\b(?:\.(\w+))?", line):
            if m.group(1) not in MANAGER_READS_ALLOWED:
                found.append(f"{i}: {line.strip()}")
    return found


def test_tests_use_eager_calls_not_the_manager():
    """``tgraph.eager_calls()`` and ``tgraph.capture_report()`` are what a user reads; a test
    that reads the manager's fields instead tests something a user cannot see."""
    found = {
        p.name: reads
        for p in sorted(TESTS.glob("*.py"))
        if p.name != Path(__file__).name and (reads := manager_reads(p.read_text()))
    }
    assert not found, (
        f"use tgraph.eager_calls() / tgraph.capture_report() (or add the field, with why, "
        f"to MANAGER_READS_ALLOWED): {found}"
    )


def test_manager_check_finds_a_private_read():
    source = (
        "from tgraph.layers.manager import _manager\n"
        "n = tgraph.layers.manager._manager.eager_calls\n"
        "units = _manager.units\n"
    )
    assert manager_reads(source) == ["2: n = tgraph.layers.manager._manager.eager_calls"]


# -- the docs cite scripts that exist; no generated output committed ---------------------------


def missing_scripts(text: str) -> list[str]:
    """The ``scripts/...`` files ``text`` cites that are not in the checkout; one cited as it
    was at a commit (```git show <commit>:scripts/x.py```) is history, not a claim."""
    cited = re.findall(r"(?<![\w:/])scripts/[\w./-]+\.(?:py|sh)\b", text)
    return sorted({s for s in cited if not (ROOT / s).is_file()})


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
)
def test_docs_cite_only_scripts_that_exist(doc):
    missing = missing_scripts((ROOT / doc).read_text())
    assert not missing, f"{doc} cites {missing}, which are not in scripts/"


def test_script_check_reads_history_as_history():
    text = "run `scripts/gpu_check.sh`; the probe (`git show 073137f^:scripts/old_probe.py`)"
    assert missing_scripts(text) == []
    assert missing_scripts("`scripts/old_probe.py --configs tiny`") == ["scripts/old_probe.py"]


def missing_result_files(text: str) -> list[str]:
    """The files of ``docs/benchmarks/`` that ``text`` names in backticks (``a_{x,y}.json``
    expanded; a name shortened with ``...`` is left out) and that are not there."""
    names = []
    for name in re.findall(r"`([\w.{},-]+\.(?:json|md|txt|log|png))`", text):
        parts = re.fullmatch(r"([^{]*)\{([^}]*)\}(.*)", name)
        expanded = [parts[1] + x + parts[3] for x in parts[2].split(",")] if parts else [name]
        names += [n for n in expanded if not n.startswith("...") and "/" not in n]
    return sorted({n for n in names if not (ROOT / "docs" / "benchmarks" / n).is_file()})


def test_benchmark_tables_name_files_that_exist():
    """Every row of docs/BENCHMARKS.md names the result file it comes from."""
    missing = missing_result_files((ROOT / "docs" / "BENCHMARKS.md").read_text())
    assert not missing, f"docs/BENCHMARKS.md names {missing}, not in docs/benchmarks/"


def test_result_file_check_expands_braces():
    assert missing_result_files("`bench_te_{none,delayed}.json` and `..._delayed.json`") == []
    assert missing_result_files("`bench_te_{none,gone}.json`") == ["bench_te_gone.json"]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_no_generated_output_is_committed():
    """The scripts write to out/ and bench_out/, the recipes to runs/: all ignored by git."""
    tracked = subprocess.run(
        ["git", "ls-files", "out", "bench_out", "runs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not tracked, f"generated output is committed: {tracked}; git rm it"
    ignored = subprocess.run(
        ["git", "check-ignore", "out/x.json", "bench_out/x.json", "runs/x/config.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(ignored) == 3, f"only {ignored} are ignored; add the others to .gitignore"

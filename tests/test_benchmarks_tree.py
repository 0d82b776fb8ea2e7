"""benchmarks/ stays navigable: one folder per benchmark, an index that names every folder, and
no document or default that points at a result file that is not there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lserve.cli import main as lserve_main

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
DOCS = [ROOT / "README.md", BENCH / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCH.glob("*/*.md"))]
# A path under benchmarks/ as documents write it (backticks, links or plain text); an output
# argument (`--out benchmarks/x`) names a file to be written, not one that exists.
PATH_RE = re.compile(r"(--out[ =])?(benchmarks/[A-Za-z0-9_./-]*[A-Za-z0-9_-])")


def test_top_level_holds_only_the_index_and_folders():
    # A fresh result lands at the top (the bench commands' default --out); it is filed into its
    # folder, with a row in the index, before it is committed.
    loose = sorted(p.name for p in BENCH.iterdir() if p.is_file() and p.name != "README.md")
    assert loose == [], f"file these into their benchmark folder: {loose}"


def test_index_names_every_folder():
    index = (BENCH / "README.md").read_text()
    folders = sorted(p.name for p in BENCH.iterdir() if p.is_dir())
    assert len(folders) >= 10
    missing = [f for f in folders if f"]({f}/" not in index]
    assert missing == [], f"benchmarks/README.md has no link into {missing}"


def test_file_names_are_unique_so_notes_can_cite_them_by_name():
    seen: dict[str, Path] = {}
    for p in sorted(BENCH.rglob("*")):
        if p.is_file() and p.name != "README.md" and "gates_h200" not in p.parts:
            assert p.name not in seen, f"{p} and {seen[p.name]} share a name"
            seen[p.name] = p


def test_documents_point_at_files_that_exist():
    broken = []
    for doc in DOCS:
        text = doc.read_text()
        for m in PATH_RE.finditer(text):
            path = m.group(2)
            if not m.group(1) and not (ROOT / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {path}")
        if doc.parent == BENCH:  # the index links relative to its own folder
            for target in re.findall(r"\]\(([^)#]+)\)", text):
                if not target.startswith("http") and not (BENCH / target).exists():
                    broken.append(f"benchmarks/README.md: {target}")
    assert broken == []


def test_calibrate_budgets_default_reproduces_the_shipped_ratios(tmp_path, capsys):
    # The default --mass is the committed selection-mass report; the shipped adaptive budgets of the
    # default model were calibrated from it (context 8192, mean 2048), and still come out the same.
    out = tmp_path / "ab.json"
    assert lserve_main(["calibrate-budgets", "--context", "8192", "--mean-budget", "2048", "--out", str(out)]) == 0
    shipped = json.loads((ROOT / "lserve/patterns/smollm2-135m/adaptive_budgets.json").read_text())
    assert json.loads(out.read_text())["ratios"] == shipped["ratios"]
    assert "mean 2048.0 tokens" in capsys.readouterr().out

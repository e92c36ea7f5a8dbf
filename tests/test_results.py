"""Figures are traceable: every result file the README and the docs cite exists, and every file
under ``benchmarks/results/`` starts with the command and the commit that produced it (the first
line ``benchmarks/record.py`` writes)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CITED = re.compile(r"benchmarks/results/[\w.\-/]*[\w\-/]")
# A clean commit: a result made from a tree with uncommitted changes names no code.
PROVENANCE = re.compile(r"^(?:# |\$ ).*\S.*\(.*\bcommit [0-9a-f]{7,40}\b(?!\+dirty)")
# Result files whose first line records no commit (made before benchmarks/record.py): each is
# to be produced again with `python benchmarks/record.py --again FILE`, and leaves this list
# when it is (the test fails while a listed file already has its commit).
AWAITING_RERUN: set[str] = set()


def _result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.suffix in (".txt", ".md"))


def _file_column_names(text: str) -> list[str]:
    """Backticked names in the cells of markdown-table columns headed "file"."""
    names, column = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            column = next((i for i, c in enumerate(cells) if "file" in c), -1)
        elif column >= 0 and column < len(cells) and not set(cells[column]) <= set("-: "):
            names += re.findall(r"`([\w.\-]+)`", cells[column])
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_results_exist(doc):
    text = doc.read_text()
    missing = [c for c in CITED.findall(text) if not (ROOT / c).exists()]
    stems = {p.stem for p in _result_files()}
    missing += [f"{n} (table)" for n in _file_column_names(text) if n not in stems]
    assert not missing, f"{doc.name} cites results that do not exist: {missing}"


def test_every_result_names_its_command_and_commit():
    lacking = []
    for path in _result_files():
        name = str(path.relative_to(RESULTS))
        first = path.read_text().split("\n", 1)[0]
        if not PROVENANCE.match(first) and name not in AWAITING_RERUN:
            lacking.append(f"{name}: {first[:100]!r}")
    assert not lacking, "result files without their command and commit on the first line:\n" + (
        "\n".join(lacking)
    )
    listed = {n for n in AWAITING_RERUN if (RESULTS / n).exists()}
    recorded = {n for n in listed if PROVENANCE.match((RESULTS / n).read_text().split("\n")[0])}
    assert not recorded, f"remove from AWAITING_RERUN, they record their commit now: {recorded}"
    assert listed == AWAITING_RERUN, f"listed but gone: {AWAITING_RERUN - listed}"


def test_record_writes_command_and_commit_and_reruns_it(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import record
    finally:
        sys.path.pop(0)
    out = tmp_path / "r" / "x.txt"
    assert record.main([str(out), "--", sys.executable, "-c", "print(6 * 7)"]) == 0
    first, body = out.read_text().split("\n", 1)
    assert re.match(r"^# .*python.* -c 'print\(6 \* 7\)'  \(commit ", first), first
    assert body == "42\n"
    assert record.recorded_command(out) == record.FIRST_LINE.match(first).group("command")
    assert record.main(["--again", str(out)]) == 0
    assert out.read_text().split("\n", 1)[1] == "42\n"
    # a failing command leaves the previous result in place
    assert record.main([str(out), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert out.read_text().split("\n", 1)[1] == "42\n"
    assert not list(out.parent.glob("*.tmp"))


def test_record_marks_a_tree_dirty_by_its_code_not_by_its_results(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import record
    finally:
        sys.path.pop(0)
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "a.py").write_text("x = 1\n")
    (repo / "benchmarks" / "results" / "r.txt").write_text("old\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "one"]):
        subprocess.run([*git, *args], check=True)
    monkeypatch.setattr(record, "ROOT", repo)
    clean = record.commit()
    assert re.fullmatch(r"[0-9a-f]{7,}", clean)
    (repo / "benchmarks" / "results" / "r.txt").write_text("new\n")  # an earlier rerun's output
    assert record.commit() == clean
    (repo / "a.py").write_text("x = 2\n")
    assert record.commit() == clean + "+dirty"


def test_interleave_alternates_the_two_trees_under_one_provenance_line(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import interleave
    finally:
        sys.path.pop(0)
    out = tmp_path / "ab.txt"
    probe = "import delta_jax, os; print(os.path.dirname(os.path.dirname(delta_jax.__file__)))"
    assert interleave.main(["--base", "HEAD", "--rounds", "2", "--out", str(out), "--",
                            sys.executable, "-c", probe]) == 0  # fmt: skip
    first, *rest = out.read_text().splitlines()
    assert re.match(r"^# python benchmarks/interleave.py --base [0-9a-f]{7,} --rounds 2 -- ", first)
    assert "(commit " in first
    titles, trees = rest[0::2], rest[1::2]
    assert [t.split(",")[0] for t in titles] == ["## round 1"] * 2 + ["## round 2"] * 2
    assert [t.split(", ")[1].split()[0] for t in titles] == ["base", "head"] * 2
    # each run imported its own tree's package; the base's worktree is gone afterwards
    assert trees[1] == trees[3] == str(ROOT) and trees[0] == trees[2] != str(ROOT)
    assert not Path(trees[0]).exists()
    with pytest.raises(SystemExit, match="failed"):
        interleave.main(["--base", "HEAD", "--", sys.executable, "-c", "raise SystemExit(3)"])


def test_performance_page_dates_match_the_results():
    """docs/performance.md dates each CPU measurement by the commit and time its result file
    records: a rerun of the benchmark must update the page too."""
    rows = re.findall(
        r"^\|[^|\n]*\|[^|\n]*\| `(benchmarks/results/[^`]+)` \| ([0-9a-f]{7,40}), ([^|]+?) \|$",
        (ROOT / "docs" / "performance.md").read_text(),
        flags=re.M,
    )
    assert len(rows) >= 10
    stale = []
    for path, commit, date in rows:
        first = (ROOT / path).read_text().split("\n", 1)[0]
        if f"(commit {commit}, {date}," not in first:
            stale.append(f"{path}: page says {commit}, {date}; file says {first!r}")
    assert not stale, "\n".join(stale)

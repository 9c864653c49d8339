"""The repo speaks of the product: no tracker references or accounts of how a measurement was run in code, docs,
scripts or tests; the performance reference links only to files the repo has; benchmarks live in benchmarks/."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Text files that people read or run. Raw benchmark output (docs/performance_data/) and generated stubs are data.
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".proto", ".html", ".yaml", ".yml", ".txt", ".cfg", ".ini"}
EXCLUDED = ("docs/performance_data/",)

# Each pattern names what it refuses; the sample beside it must match (checked below).
FORBIDDEN = {
    "tracker reference": (re.compile(r"\bissues?\s?#?\d+", re.I), "see " + "issue" + " 12"),
    "tracker number": (re.compile(r"(?<![\w&/'\"])#\d+ "), "as in " + "#" + "12 said"),
    "work-session account": (
        re.compile(r"\b(first|second|third|fourth|fifth|sixth|this|that|previous|last|next|one) session\b", re.I),
        "in the third " + "session"),
    "device-call account": (re.compile(r"\bdevice (call|time|tool)s?\b|\bcalls? \d+\b", re.I), "in " + "call" + " 4"),
    "machine-availability account": (re.compile(r"\b(was|were|is|are) not lent\b|\bnvidia-h\d00(-x\d)?\b", re.I),
                                     "the kind " + "nvidia-" + "h200-x2"),
}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names
            if Path(n).suffix in TEXT_SUFFIXES and not n.startswith(EXCLUDED) and not n.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
            and (REPO / n).is_file()]


def test_the_patterns_catch_their_samples():
    for what, (pattern, sample) in FORBIDDEN.items():
        assert pattern.search(sample), what
    assert not FORBIDDEN["work-session account"][0].search("one stack per test session (a pytest fixture scope)")
    assert not FORBIDDEN["tracker number"][0].search("the fd pointed at out/#123 (deleted)")


def test_code_docs_scripts_and_tests_speak_of_the_product():
    hits = []
    for path in tracked_text_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, (pattern, _) in FORBIDDEN.items():
                if pattern.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{lineno}: {what}: {line.strip()[:120]}")
    assert not hits, "say what holds and why; history belongs in commit messages:\n" + "\n".join(hits)


def test_the_performance_reference_is_short_and_its_links_exist():
    text = (REPO / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\((performance_data/[^)]+|[\w.]+\.md)\)", text)
    assert links
    missing = [link for link in links if not (REPO / "docs" / link).exists() and link != "one_card.md"]
    assert not missing, missing


def test_docs_cite_only_files_the_repo_has():
    """A doc that names a top-level design file must find it in the repo (docs cite `docs/`, never outside files)."""
    for doc in (REPO / "docs").glob("*.md"):
        for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", doc.read_text()):
            assert list(REPO.rglob(name)) or (REPO / "docs" / name).exists(), f"{doc.name} cites {name}"


def test_benchmarks_live_in_benchmarks():
    """scripts/ holds the operations scripts (up, down, setup, ...); every benchmark is in benchmarks/."""
    stray = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name.startswith(("bench_", "kernel_")))
    assert not stray, f"move to benchmarks/: {stray}"

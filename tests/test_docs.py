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
    # What the code did before a change, or how a measurement came about: history, not what holds.
    "account of a change": (re.compile(
        r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bwas )(?<!\bwere )\bused to (be|cost|fail|keep|blame|encode|read"
        r"|run|take|leave|hold|print|say|give|send|break|unload|load|start|stop|count|go|get|wait|echo)\b"
        r"|\b(before|after|until) (the |this |that )?fix(es)?\b|\bafter fix [A-Z]?\d|\(fixed[,)]|\bthe fix lands\b"
        r"|[(;]\s*(before|previously|formerly):\s(?!(dict|list|int|str|float|bool|bytes|Path)\b)|\(was [`'\"]"
        r"|\bmeasured before (the|this|its)\b|\bnot re-?run after\b|\bthe run before\b"
        r"|\bearlier (\w+ )?(run|runs|measurement)\b|\b(this|the last|last full|the previous) run\b(?![ -]?dir)"
        r"|\bthe previous (default|path|version|code|math)\b|\bthe default now\b|\btoday's (code|tree)\b", re.I),
        "it " + "used to" + " encode the whole file"),
    # Limits of the machine or tool that ran a measurement (what it could carry, how long it could run).
    "account of the machine a run used": (re.compile(
        r"\b\d+ MiB carry\b|\bone carry\b|\bcarr(y|ied) there\b|\bcarry the one\b|`carr[y]`|\bat most \d+ files\b"
        r"|\b\d+ files at most\b|\$OUT on the[ ]device\b|\bdevice[ ]machine\b|\b\d+ s of wall time\b|\bprinted[ ]only\b", re.I),
        "over the 64 MiB " + "carry"),
}

# Product wording the patterns above must let through.
ALLOWED = ("X is used to run the tests", "Used to build test / random checkpoints", "started for this run dir",
           "the audio carry (ComfyUI)", "a message may carry the request", "def count_delta(before: dict, after: dict)",
           "reduced by torch (fixed order: deterministic)", "a row written by an earlier version of the service",
           "never finds the previous one still resident", "forms that run on a CPU", "before the first job",
           "a buffer fixed by the config", "the stage is restarting its ranks")


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
    for text in ALLOWED:
        assert not [what for what, (pattern, _) in FORBIDDEN.items() if pattern.search(text)], text
    change = FORBIDDEN["account of a change"][0]
    history = ("the first Decode fails (" + "was `INTERNAL`)", "INVALID_ARGUMENT (15 ms; " + "before: accepted)",
               "✅ (after " + "fix F1)", "measured " + "before the Triton kernels", "Not re-" + "run after" + " the fixes",
               "an earlier " + "run of the scenarios", "1.006 s in this " + "run", "(the previous " + "default)",
               "+ O rows at 1×4 (today'" + "s code)")
    for text in history:
        assert change.search(text), text
    machine = FORBIDDEN["account of the machine a run used"][0]
    for text in ("writes to --out (at most 8 " + "files)", "within 540 s of wall " + "time", "(site.tar.xz carried " + "there)",
                 "numbers: printed " + "only"):
        assert machine.search(text), text


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


def test_every_number_in_the_performance_reference_names_its_json():
    """docs/performance.md puts each measurement in a table row that links the JSON (or log) it comes from; prose
    carries no measured numbers (versions, sizes and caps are conditions, not measurements)."""
    lines = (REPO / "docs" / "performance.md").read_text().splitlines()
    unlinked, in_prose = [], []
    for i, line in enumerate(lines):
        if line.startswith("|"):
            header = i + 1 < len(lines) and lines[i + 1].startswith("|---")
            if not header and not line.startswith("|---") and re.search(r"\d", line) and "](performance_data/" not in line:
                unlinked.append(line[:100])
        elif re.search(r"\b\d[\d,]*\.\d+ ?(ms|s|GiB|GB/s|TB/s|TFLOP/s|TOPS|MHz|×)(?!\w)", line):
            in_prose.append(line[:100])
    assert not unlinked, f"table rows without their JSON: {unlinked}"
    assert not in_prose, f"measured numbers outside a table row: {in_prose}"


def test_docs_cite_only_files_the_repo_has():
    """A doc that names a top-level design file must find it in the repo (docs cite `docs/`, never outside files)."""
    for doc in (REPO / "docs").glob("*.md"):
        for name in re.findall(r"\b([A-Z][A-Z_]+\.md)\b", doc.read_text()):
            assert list(REPO.rglob(name)) or (REPO / "docs" / name).exists(), f"{doc.name} cites {name}"


def test_benchmarks_live_in_benchmarks():
    """scripts/ holds the operations scripts (up, down, setup, ...); every benchmark is in benchmarks/."""
    stray = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name.startswith(("bench_", "kernel_")))
    assert not stray, f"move to benchmarks/: {stray}"

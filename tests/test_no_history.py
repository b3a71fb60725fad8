"""The product speaks of the product: no tracked file cites the development history (numbered sessions, calls or
issues, or parts named after them). A change is described by what it does, and measurements by the command that
reproduces them (benchmarks/results/*.json, docs/performance.md)."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"\b(session|sessions) [0-9]+|\bcalls? [0-9]+(-[0-9]+)?\b|\bissues? [0-9]+\b|\bissue-[0-9]+\b",
                      re.IGNORECASE)


def tracked_text_files() -> list[Path]:
    """The files git tracks and the untracked ones it does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.splitlines() if (ROOT / name).is_file()]


def citations(text: str) -> list[str]:
    """The history citations in ``text``: each match of :data:`CITATION` with its line."""
    return [line.strip()[:120] for line in text.splitlines() if CITATION.search(line)]


def test_the_pattern_finds_citations_and_spares_ordinary_text():
    # the examples are assembled so that this file does not match its own pattern
    examples = [" ".join(pair) for pair in [("fixed in session", "32"), ("see calls", "63-65"), ("issue", "17's target"),
                                            ("call", "7 ran"), ("Issue", "13 item 2")]]
    assert len(citations("\n".join(examples))) == 5
    assert len(citations("a\n" + examples[0] + "\nb")) == 1
    assert citations("the sessions of a user\ncall the function 3 times\nissue a warning\nstep 4 of 10") == []


def test_no_tracked_file_cites_development_history():
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{path.relative_to(ROOT)}: {line}" for line in citations(text)]
    assert hits == [], "history citations (describe the change itself):\n" + "\n".join(hits[:40])


def test_every_script_the_docs_name_exists():
    """A script named in README.md or docs/ (``scripts/NAME.py``, ``scripts/NAME.sh``) is in the tree: deleting a
    one-off script must not leave a command behind that points at it."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in sorted(set(re.findall(r"scripts/[\w.-]+\.(?:py|sh)", doc.read_text(encoding="utf-8")))):
            if not (ROOT / name).is_file():
                missing.append(f"{doc.name}: {name}")
    assert missing == []

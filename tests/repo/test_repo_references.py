"""Nothing in the repository points at a document outside it.

The design lives in docs/architecture.md. Every tracked text file is scanned for references to
documents a clone does not contain (the old shared design notes, paths above the checkout) and
every relative Markdown link must resolve to a tracked file inside the repository.

One outside path is data, not a document: the upstream Kubernetes CRD files the Helm chart tests
validate against are read from `shared/schemas` next to the clone (about 2 MB of verbatim copies;
CI provides the directory and those tests skip without it). Only the files listed in
`CRD_DATA_USERS` may name that directory, and only it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# What each pattern catches, so a failure says why the reference is wrong.
OUTSIDE_DOCUMENTS = {
    "the shared design notes (use docs/architecture.md)": re.compile(r"DESIGN\.md", re.I),
    "the shared directory above the checkout": re.compile(r"\.\./shared\b"),
    # NOTE: spelled in pieces so this file does not itself contain the path it forbids.
    "a machine-specific absolute path": re.compile(r"(?<![\w.~-])/" + "work" + "/"),
    "a document of the shared directory": re.compile(
        r"shared/(?!schemas\b)|shared/schemas/\w+\.md"
    ),
}
CRD_DATA_USERS = {"tests/helm_utils.py", "tests/k8s/test_helm_chart.py", "k8s/shortconv/README.md"}
_SHARED_DIR = re.compile(r"(?<![\w-])shared/")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def tracked_paths() -> set[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return set(filter(None, out.stdout.decode().split("\0")))


@pytest.fixture(scope="module")
def tracked(tracked_paths: set[str]) -> dict[str, str]:
    """Every tracked text file but this one (it spells the patterns out)."""
    texts = {}
    for rel in sorted(tracked_paths):
        path = ROOT / rel
        if rel == THIS or not path.is_file():
            continue
        try:
            texts[rel] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
    return texts


def test_no_reference_to_an_outside_document(tracked: dict[str, str]) -> None:
    found = []
    for rel, text in tracked.items():
        for lineno, line in enumerate(text.splitlines(), 1):
            for why, pattern in OUTSIDE_DOCUMENTS.items():
                if pattern.search(line):
                    found.append(f"{rel}:{lineno}: {why}: {line.strip()[:120]}")
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_only_the_crd_tests_name_the_shared_directory(tracked: dict[str, str]) -> None:
    users = {rel for rel, text in tracked.items() if _SHARED_DIR.search(text)}
    assert users <= CRD_DATA_USERS, sorted(users - CRD_DATA_USERS)


def test_markdown_links_stay_inside_the_repository(
    tracked: dict[str, str], tracked_paths: set[str]
) -> None:
    bad = []
    for rel, text in tracked.items():
        if not rel.endswith(".md"):
            continue
        for target in _MD_LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http:, mailto:) or an anchor in the same page
            resolved = ((ROOT / rel).parent / target.split("#")[0]).resolve()
            inside = resolved.is_relative_to(ROOT)
            if not inside or resolved.relative_to(ROOT).as_posix() not in tracked_paths:
                bad.append(f"{rel}: ({target})")
    assert not bad, "Markdown links to files the repository does not contain:\n" + "\n".join(bad)


def test_readme_links_the_architecture() -> None:
    assert (ROOT / "docs" / "architecture.md").is_file()
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text()

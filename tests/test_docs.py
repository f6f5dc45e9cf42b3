"""The documents keep up with the code: every setting is in the README under its environment name and flag, the README
stays short, and nothing cites a document the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

from h3serve.settings import CLI_FIELDS, Settings, env_name, flag_name

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
README_MAX_WORDS = 2600
# Documents that were cited in the past but live outside the repository (research notes, the house style). Their facts
# are in docs/ (model.md, design.md, operators.md) or cited from their public sources instead. Spelled as stems so
# that this file does not name them itself.
MISSING_DOCUMENTS = ("ARCHITECTURE", "PERFORMANCE", "ECOSYSTEM", "PERF_ANCHORS", "SERVING", "PARALLEL", "LORA")
MISSING_DOCUMENTS += ("DESIGN", "STYLE")
# `NAME.md`, or the bare name followed by a section sign (`NAME §5`), as the old citations read.
MISSING_CITATION = re.compile(rb"\b(" + "|".join(MISSING_DOCUMENTS).encode() + rb")(\.md\b|\s*\xc2\xa7)")
SCANNED = ("src", "tests", "bench", "docs", "deploy")
SKIPPED_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}


def scanned_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if path.is_file() and not parts & SKIPPED_PARTS and not any(p.endswith(".egg-info") for p in parts):
                files.append(path)
    return files


def test_every_setting_is_in_the_readme_table():
    rows = {line.split("|")[1].strip(" `") for line in README.splitlines() if line.startswith("| `H3_")}
    assert rows == {env_name(name) for name in Settings.model_fields}
    for name in CLI_FIELDS:
        assert f"`{flag_name(name)}`" in README, name


def test_readme_stays_short():
    words = len(README.split())  # as `wc -w` counts
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS}): move detail to docs/"


def test_no_file_cites_a_document_outside_the_repository():
    found = []
    for path in scanned_files():
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if MISSING_CITATION.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}")
    assert not found, "cites a document that is not in the repository (bring the fact into docs/): " + ", ".join(found)


def test_the_missing_document_check_catches_both_spellings():
    first, second = MISSING_DOCUMENTS[0], MISSING_DOCUMENTS[4]  # joined here, so that this file names neither
    assert MISSING_CITATION.search(f"see {first}.md".encode())
    assert MISSING_CITATION.search(f"as in {second} §4".encode())
    assert not MISSING_CITATION.search("see docs/design.md and docs/model.md §5".encode())


def test_cited_docs_and_sections_exist():
    """Every `docs/NAME.md` named anywhere exists, and every `docs/model.md §N` is a heading there."""
    model = (ROOT / "docs" / "model.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## §(\d+) ", model, flags=re.MULTILINE))
    for path in scanned_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        for name in re.findall(r"\bdocs/([a-z_]+\.md)", text):
            assert (ROOT / "docs" / name).is_file(), f"{path.relative_to(ROOT)} names docs/{name}"
        for section in re.findall(r"docs/model\.md §(\d+)", text):
            assert section in sections, f"{path.relative_to(ROOT)} names docs/model.md §{section}"


def test_markdown_links_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}"


def test_recorded_result_files_exist():
    """Every dated result file the measurements README names is in bench/results/."""
    results = ROOT / "bench" / "results"
    text = (results / "README.md").read_text(encoding="utf-8")
    for name in set(re.findall(r"`(\d{4}-\d{2}-\d{2}-[A-Za-z0-9._-]+\.(?:json|txt))`", text)):
        assert (results / name).is_file(), name

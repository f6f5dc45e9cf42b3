"""The documents keep up with the code: the settings' tables (README, docs/operators.md) and deploy/.env.example say
what the schema's descriptions say, and nothing cites a document the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3serve import settings_doc
from h3serve.settings import CLI_FIELDS, NO_FLAG, Settings, env_name, flag_name

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
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


def table_rows(text: str) -> dict[str, list[str]]:
    """A markdown file's settings rows: {`H3_X`: [flag, meaning, default]}."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `H3_"):
            env, *cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[env.strip("`")] = cells
    return rows


def test_every_setting_is_in_the_operators_table_and_the_readme_holds_the_newcomers():
    operators = table_rows((ROOT / "docs" / "operators.md").read_text(encoding="utf-8"))
    assert list(operators) == [env_name(name) for name in Settings.model_fields]
    for name in Settings.model_fields:
        flag = operators[env_name(name)][0]
        assert flag == (f"`{flag_name(name)}`" if name in CLI_FIELDS else "(none: never on a command line)"), name
    assert set(NO_FLAG) <= set(Settings.model_fields)
    readme = table_rows(README)
    assert list(readme) == [env_name(name) for name in settings_doc.README_SETTINGS]
    assert all(readme[env] == operators[env] for env in readme)  # the same row in both tables
    assert "docs/operators.md#settings" in README


@pytest.mark.parametrize("block", [settings_doc.README, settings_doc.OPERATORS, settings_doc.ENV_EXAMPLE])
def test_the_generated_settings_text_is_the_schemas(block):
    """README, operators table and .env.example hold what `python -m h3serve.settings_doc --write` makes of the schema
    now: a description changed in settings.py and not regenerated (or a row edited by hand) fails here."""
    expected = settings_doc.generated(ROOT)[block]
    held = block.current((ROOT / block.path).read_text(encoding="utf-8"))
    assert held == expected, f"{block.path} is stale: run python -m h3serve.settings_doc --write"


def test_a_changed_description_makes_every_generated_file_stale(monkeypatch):
    """The check above can fail: a schema description changed in memory is seen in all three files, and only there."""
    assert settings_doc.stale(ROOT) == []
    field = Settings.model_fields["device"]  # a setting of the README's table, the full table and .env.example
    monkeypatch.setattr(field, "description", field.description + "; and a drifted word")
    assert settings_doc.stale(ROOT) == ["README.md", "docs/operators.md", "deploy/.env.example"]
    assert "drifted" in settings_doc.readme_table() and "drifted" in settings_doc.env_entries({})


def test_a_row_edited_by_hand_is_stale(tmp_path):
    for block in settings_doc.generated(ROOT):
        path = tmp_path / block.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((ROOT / block.path).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "deploy" / "compose.yaml").write_text((ROOT / "deploy" / "compose.yaml").read_text(encoding="utf-8"))
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8").replace("released checkpoint folder", "checkpoint folder", 1))
    assert settings_doc.stale(tmp_path) == ["README.md"]
    assert settings_doc.write(tmp_path) == ["README.md"] and settings_doc.stale(tmp_path) == []
    assert readme.read_text(encoding="utf-8") == README


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


def test_ci_runs_the_readmes_test_command_verbatim():
    """.ci/run calls command 2 of the README's set-up as written there, so the two cannot drift apart; the command
    makes (or reuses) and activates the environment itself, so it runs alone in a fresh clone and after command 1."""
    commands = re.findall(r"^# 2\..*\n(.+)$", README, flags=re.MULTILINE)
    assert len(commands) == 1, "the README's set-up has one command 2"
    command = commands[0].strip()
    assert command.startswith("python3.11 -m venv .venv && . .venv/bin/activate && "), command
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert command in [line.strip() for line in ci]


def test_the_readmes_range_of_render_settings_is_the_render_flags():
    """The README says which rows of the settings table are `render` flags by naming the last one: it must be the
    last engine setting, and every engine setting with a flag must be a flag of `render`, and no service setting."""
    import argparse

    from h3serve.cli import build_parser
    from h3serve.settings import ENGINE_FIELDS

    named = re.search(r"every row of the full settings table up to\s+`(H3_[A-Z0-9_]+)`", README)
    assert named, "the README names the last row that is a render flag"
    assert named.group(1) == env_name(ENGINE_FIELDS[-1])
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {flag for action in commands.choices["render"]._actions for flag in action.option_strings}
    for field in ENGINE_FIELDS:
        assert field in NO_FLAG or flag_name(field) in flags, field
    # The service's settings are not render's (render's own --preview-every is a request flag, not the setting).
    service = [f for f in Settings.model_fields if f not in ENGINE_FIELDS and f not in NO_FLAG]
    assert service and not [f for f in service if flag_name(f) in flags and f != "preview_every"]

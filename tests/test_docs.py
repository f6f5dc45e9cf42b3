"""The README keeps up with the code: every setting is documented under its environment name and flag."""

from __future__ import annotations

from pathlib import Path

from h3serve.settings import CLI_FIELDS, Settings, env_name, flag_name

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def test_every_setting_is_in_the_readme_table():
    rows = {line.split("|")[1].strip(" `") for line in README.splitlines() if line.startswith("| `H3_")}
    assert rows == {env_name(name) for name in Settings.model_fields}
    for name in CLI_FIELDS:
        assert f"`{flag_name(name)}`" in README, name

"""The settings' documentation, generated from the schema: the full table in docs/operators.md, the newcomer's table in
the README and the per-setting entries of deploy/.env.example. Each setting's text lives once, in its
`Field(description=...)` in `h3serve.settings` (also its `--help` text); these files hold a copy between marker
lines, and `tests/test_docs.py` fails when a copy differs from what this module makes of the schema.

    python -m h3serve.settings_doc --write    # regenerate the three files in place (from a checkout)
    python -m h3serve.settings_doc --check    # exit 1 and name the stale files
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from h3serve.errors import NO_FLAG, env_name, flag_name
from h3serve.settings import EngineSettings, Settings

# The settings a newcomer needs (the README's table); the rest are in docs/operators.md's full table.
README_SETTINGS = (
    "model",
    "device",
    "diffusion_attention_backend",
    "execution_mode",
    "linear_backend",
    "cache_backend",
    "lora",
    "num_gpus",
    "offload",
    "device_memory_gib",
    "bind_host",
    "api_key",
    "output_dir",
)
ENV_WIDTH = 120  # the repository's line length
# compose.yaml's `- H3_X=value` lines: the settings it fixes to the image's paths (the others are passed through).
COMPOSE_FIXED = re.compile(r"^\s*-\s*(H3_[A-Z0-9_]+)=(\S+)\s*$", re.MULTILINE)


def default_text(name: str) -> str:
    """A setting's default as the tables write it: "unset" for None, an enum's value, true/false."""
    default = Settings.model_fields[name].default
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, enum.Enum):
        return str(default.value)
    return str(default)


def description(name: str) -> str:
    return " ".join((Settings.model_fields[name].description or "").split())


def markdown_table(names: tuple[str, ...] | list[str]) -> str:
    """The table of `names`: environment variable, flag, meaning, default."""
    lines = ["| environment | flag | meaning | default |", "|---|---|---|---|"]
    for name in names:
        flag = "(none: never on a command line)" if name in NO_FLAG else f"`{flag_name(name)}`"
        default = default_text(name)
        default = default if default == "unset" else f"`{default}`"
        meaning = description(name).replace("|", "\\|")
        lines.append(f"| `{env_name(name)}` | {flag} | {meaning} | {default} |")
    return "\n".join(lines)


def full_table() -> str:
    engine = len(EngineSettings.model_fields)
    note = (
        f"The first {engine} rows are the engine's (`render`, `serve` and `check` take them); the rest are the "
        "service's (`serve`, `check`, `ready`)."
    )
    return note + "\n\n" + markdown_table(list(Settings.model_fields))


def readme_table() -> str:
    return markdown_table(README_SETTINGS)


def env_entries(fixed: dict[str, str]) -> str:
    """deploy/.env.example's entries: each setting's description and default as a comment, then its assignment,
    commented out (the server's default applies); a setting compose.yaml `fixed` to a path gets no assignment."""
    out: list[str] = []
    groups = (
        ("The engine (render takes these too)", [n for n in Settings.model_fields if n in EngineSettings.model_fields]),
        ("The service", [n for n in Settings.model_fields if n not in EngineSettings.model_fields]),
    )
    for title, names in groups:
        out.append(f"# ---- {title} ".ljust(ENV_WIDTH, "-"))
        for name in names:
            var = env_name(name)
            default = default_text(name)
            text = f"{var}: {description(name)}."
            if not (default == "unset" and "unset:" in text):  # the description says what unset means
                text += f" Default: {default}."
            if var in fixed:
                text += f" Fixed by compose.yaml to {fixed[var]} (a value here would be ignored)."
            out += textwrap.wrap(
                text, ENV_WIDTH, initial_indent="# ", subsequent_indent="#   ", break_long_words=False,
                break_on_hyphens=False,
            )  # fmt: skip
            if var not in fixed:
                out.append(f"# {var}={'' if default == 'unset' else default}")
    return "\n".join(out)


@dataclass(frozen=True)
class Block:
    """A generated part of a file: the lines between `begin` and `end`."""

    path: str  # relative to the repository root
    begin: str
    end: str

    def replace(self, text: str, content: str) -> str:
        """`text` with the lines between the markers replaced by `content` (ValueError when a marker is missing)."""
        head, sep, rest = text.partition(self.begin + "\n")
        _, sep2, tail = rest.partition(self.end)
        if not sep or not sep2:
            raise ValueError(f"{self.path}: the markers {self.begin!r} and {self.end!r} are missing")
        return head + sep + content + "\n" + sep2 + tail

    def current(self, text: str) -> str:
        """The content between the markers as the file holds it."""
        return text.partition(self.begin + "\n")[2].partition(self.end)[0].removesuffix("\n")


MD_COMMENT = "generated from the schema by `python -m h3serve.settings_doc --write`; edit settings.py, not here"
README = Block("README.md", f"<!-- settings:begin ({MD_COMMENT}) -->", "<!-- settings:end -->")
OPERATORS = Block("docs/operators.md", f"<!-- settings:begin ({MD_COMMENT}) -->", "<!-- settings:end -->")
ENV_EXAMPLE = Block(
    "deploy/.env.example",
    "# ==== settings:begin (generated by `python -m h3serve.settings_doc --write` from src/h3serve/settings.py) ====",
    "# ==== settings:end",
)


def compose_fixed(root: Path) -> dict[str, str]:
    """The settings deploy/compose.yaml sets to a value (the image's paths), read from its environment lines."""
    return dict(COMPOSE_FIXED.findall((root / "deploy" / "compose.yaml").read_text(encoding="utf-8")))


def generated(root: Path) -> dict[Block, str]:
    """What belongs between each block's markers, from the schema as it is now."""
    return {README: readme_table(), OPERATORS: full_table(), ENV_EXAMPLE: env_entries(compose_fixed(root))}


def stale(root: Path) -> list[str]:
    """The files whose generated part differs from the schema's text."""
    out = []
    for block, content in generated(root).items():
        if block.current((root / block.path).read_text(encoding="utf-8")) != content:
            out.append(block.path)
    return out


def write(root: Path) -> list[str]:
    """Regenerate every block in place; the files changed."""
    changed = []
    for block, content in generated(root).items():
        path = root / block.path
        text = path.read_text(encoding="utf-8")
        new = block.replace(text, content)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(block.path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3serve.settings_doc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository checkout (default: here)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the files in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.write:
        for path in write(args.root):
            print(f"rewrote {path}")
        return 0
    found = stale(args.root)
    for path in found:
        print(f"{path}: stale; run python -m h3serve.settings_doc --write", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())

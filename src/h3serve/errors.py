"""A refused setting, as data: `SettingError(setting, message)` carries the schema's field name, and its text is
formatted here, the one place that knows how a setting is named to people (`H3_X (--x)`).

Everything below `settings.py` (the checkpoint readers, the admission, the split's plan, the start-up checks) raises
SettingError with the field name and a message that does not repeat the label; whoever shows it (the CLI, the
settings' violation list, the service's log) reads `err.setting` rather than parsing the text.

A value a message echoes, a setting's or a client's, is written by `shown`: at most ECHO_CHARS characters of it.

How a number a person types is read is here too (`whole_number`, `decimal_number`), so that a setting, a flag, a port
in an address and an adapter's scale are read by one rule: ASCII digits. Python's int() and float() also take other
scripts' digits ("٨٠٨٠", full-width "８０８０"), "²", "1_000" and surrounding space, and fail in their own words.
`did_you_mean` is the one way a misspelt name is answered, for a flag, an H3_ variable and a config-file key alike.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from pathlib import Path

ENV_PREFIX = "H3_"
# The key is never a flag: a command line is visible to every user of the host (ps).
NO_FLAG = frozenset({"api_key", "node_key"})
# The most characters of a value a message echoes (docs/api.md promises it for the API; the settings keep it too).
ECHO_CHARS = 80
# A path is echoed longer: it is the operator's own, and its file name, the part that tells, is at its end. Longer
# than this it names no file anyway (PATH_MAX is 4096 bytes, a name at most 255), so nothing useful is cut.
PATH_ECHO_CHARS = 300
WHOLE_NUMBER = re.compile(r"-?[0-9]+")
DECIMAL_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# How close a misspelling must be to a real name to be offered (difflib's ratio; the step-cache options' cutoff too).
CLOSE_NAME = 0.6


def env_name(setting: str) -> str:
    """The setting's environment variable: `num_gpus` -> `H3_NUM_GPUS`."""
    return ENV_PREFIX + setting.upper()


def flag_name(setting: str) -> str:
    """The setting's command-line flag: `num_gpus` -> `--num-gpus`."""
    return "--" + setting.replace("_", "-")


def label(setting: str) -> str:
    """How a setting is named to people: `H3_NUM_GPUS (--num-gpus)`, or the variable alone for one with no flag."""
    return env_name(setting) if setting in NO_FLAG else f"{env_name(setting)} ({flag_name(setting)})"


class SettingError(ValueError):
    """A setting refused: `setting` is the schema's field name (`num_gpus`), `message` what is wrong and what is
    allowed, without the label, which `str()` puts first."""

    def __init__(self, setting: str, message: str):
        super().__init__(f"{label(setting)}: {message}")
        self.setting = setting
        self.message = message


def escaped(text: str) -> str:
    """`text` with any lone surrogate written as its escape (\\ud800): always encodable, so safe in a response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: object, limit: int = ECHO_CHARS) -> str:
    """A value as a message may echo it (a client's in the API, an operator's in a settings refusal): in JSON's
    spelling (null, true, "text"), text cut at `limit` characters and followed by its length, lone surrogates escaped,
    a long integer by its digit count, an array or object by its size; never a Python repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        digits = len(str(abs(value))) if abs(value) < 10**40 else None
        return str(value) if digits is not None and digits <= 24 else "an integer of more than 24 digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        text = escaped(value)
        if len(text) > limit:
            return json.dumps(text[:limit], ensure_ascii=False)[:-1] + f'..." ({len(value)} characters)'
        return json.dumps(text, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return f"an array of {len(value)} item(s)"
    if isinstance(value, dict):
        return f"an object with {len(value)} key(s)"
    text = str(value)  # a value type of our own (bodies.LongInt says "an integer of N digits")
    return text if len(text) <= limit and " object at 0x" not in text else f"a value of type {type(value).__name__}"


def shown_path(path: Path | str) -> str:
    """A path as a message names it: quoted as `shown` writes text, cut at PATH_ECHO_CHARS characters."""
    return shown(str(path), PATH_ECHO_CHARS)


def whole_number(text: str) -> int:
    """`text` read as a whole number: an optional '-' and the ASCII digits 0-9, nothing else (no other script's
    digits, no '_', '+' or space); ValueError in our words otherwise (the caller adds what the number is for)."""
    if not WHOLE_NUMBER.fullmatch(text):
        raise ValueError("must be a whole number written in the digits 0-9")
    return int(text)


def decimal_number(text: str, *, infinite: bool = False) -> float:
    """`text` read as a number: ASCII digits with an optional '-', '.' and exponent (`1.5`, `.5`, `2e3`); `inf` only
    where `infinite` is allowed. ValueError in our words otherwise."""
    if infinite and text in ("inf", "infinity"):
        return float("inf")
    if not DECIMAL_NUMBER.fullmatch(text):
        raise ValueError("must be a number written in the digits 0-9 (with an optional '.' and exponent, e.g. 1.5)")
    return float(text)


def did_you_mean(name: str, names: Iterable[str]) -> str | None:
    """The one of `names` closest to a misspelt `name` (difflib, case-insensitive), or None when none is close."""
    names = list(names)
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=CLOSE_NAME)
    return by_lower[close[0]] if close else None

"""A refused setting, as data: `SettingError(setting, message)` carries the schema's field name, and its text is
formatted here, the one place that knows how a setting is named to people (`H3_X (--x)`).

Everything below `settings.py` (the checkpoint readers, the admission, the split's plan, the start-up checks) raises
SettingError with the field name and a message that does not repeat the label; whoever shows it (the CLI, the
settings' violation list, the service's log) reads `err.setting` rather than parsing the text.
"""

from __future__ import annotations

ENV_PREFIX = "H3_"
# The key is never a flag: a command line is visible to every user of the host (ps).
NO_FLAG = frozenset({"api_key"})


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

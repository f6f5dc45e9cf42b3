"""What every `h3serve` command shares: its one-line error, exit codes, reading the settings, and start-up refusals as
CLI errors."""

from __future__ import annotations

import argparse
import contextlib
import signal
from collections.abc import Iterator

from h3serve.errors import SettingError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, a shell's status for a command ended by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


class CliError(Exception):
    """A user-facing error: printed as one line, exit status EXIT_ERROR."""


def read_settings(args: argparse.Namespace, check_profile: bool = True, engine_only: bool = False):
    from h3serve.settings import EngineSettings, Settings, SettingsError, load_settings

    try:
        schema = EngineSettings if engine_only else Settings
        return load_settings(args, check_profile=check_profile, schema=schema)
    except SettingsError as err:
        lines = "\n".join(f"  - {v}" for v in err.violations)
        raise CliError(f"{len(err.violations)} setting(s) refused:\n{lines}") from err


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """A start-up refusal (`h3serve.startup`: a SettingError naming its setting, or a StartupError) as one CLI error
    line; every command's start goes through the same checks, so each says the same words."""
    from h3serve.startup import StartupError

    try:
        yield
    except (SettingError, StartupError) as err:
        raise CliError(str(err)) from err

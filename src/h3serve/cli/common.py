"""What every `h3serve` command shares: its one-line error, exit codes, the parser (a usage error in a line or two,
the nearest real flag named), numbers read as ASCII digits, reading the settings, and start-up refusals as CLI
errors."""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn

from h3serve.errors import (
    NO_FLAG,
    SettingError,
    decimal_number,
    did_you_mean,
    env_name,
    flag_name,
    shown,
    whole_number,
)

EXIT_ERROR = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, a shell's status for a command ended by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
EXIT_USAGE = 2  # argparse's status for a command line it refuses
NEGATIVE_NUMBER = re.compile(r"-[0-9.]+")  # a value such as `--seed -1`, not a flag


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


# ---- the command line ------------------------------------------------------------------------------------------------
class UsageError(SystemExit):
    """A command line argparse refused: `parser` is the (sub)command's, `message` argparse's words. A SystemExit of
    status EXIT_USAGE, as argparse's own, for a caller of `parse_args` other than `parse_command_line`."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(EXIT_USAGE)
        self.parser = parser
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are raised (UsageError) for `parse_command_line` to answer in a line or
    two, not with the whole usage (render's is 40 lines). `not_flags`: {flag: what to write instead} for a flag a new
    user may guess that does not exist by design; `{value}` in it is the value the user gave it, quoted for a shell."""

    def __init__(self, *args, not_flags: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.not_flags = dict(not_flags or {})

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def parse_command_line(parser: Parser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line. What argparse refuses is answered on stderr in a line or two, each naming what to
    write instead: an unknown flag's nearest real one, the environment variable of a setting that is never a flag
    (the keys), the argument of render's prompt; then exit EXIT_USAGE."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, unknown = parser.parse_known_args(argv)
        refused: UsageError | None = None
    except UsageError as err:
        args, unknown, refused = None, None, err
    if refused is None and not unknown:
        return args
    command, tokens = _command(parser, argv)
    lines: list[str] = []
    if command is not None and not any(a.nargs == argparse.REMAINDER for a in command._actions):
        strays = _stray_flags(command, tokens)
        lines += [_unknown_flag(command, flag, value) for flag, value in strays]
        if not strays:  # (a stray flag's value shifts the arguments after it: only without one are they extra)
            extra = [token for token in unknown or () if not token.startswith("-")]
            lines += [_unexpected(command, tokens, token) for token in extra]
    if refused is not None:
        where = refused.parser
        if where is parser and command is None:
            lines.append(_unknown_command(parser, argv))
        else:
            lines.append(refused.message)
        command = command or where
    elif not lines:
        lines.append(f"unrecognized arguments: {' '.join(unknown or ())}")
    prog = (command or parser).prog
    for line in lines:
        print(f"{prog}: error: {line}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _command(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser | None, list[str]]:
    """The subcommand's parser named in `argv` and the tokens after its name, or (None, []) without one."""
    commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if commands is None:
        return None, []
    for index, token in enumerate(argv):
        if token in commands.choices:
            command, tokens = commands.choices[token], argv[index + 1 :]
            deeper, rest = _command(command, tokens)  # a command's own subcommand (`store rebuild`)
            return (deeper, rest) if deeper is not None else (command, tokens)
        if not token.startswith("-"):
            break
    return None, []


def _unexpected(parser: argparse.ArgumentParser, tokens: list[str], token: str) -> str:
    """One line for an argument `parser` did not expect: a value given to a switch (`--startup-warmup false`: a
    switch takes none, its `--no-` form turns it off), else a value of several words left unquoted."""
    index = tokens.index(token) if token in tokens else 0
    before = parser._option_string_actions.get(tokens[index - 1]) if index > 0 else None
    if before is not None and before.nargs == 0:
        forms = " or ".join(name for name in before.option_strings if name.startswith("--"))
        return f"{tokens[index - 1]} takes no value (got {shown(token)}): write {forms}"
    return f"unexpected argument {shown(token)} (a value of several words is one argument: quote it)"


def _unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    word = next((token for token in argv if not token.startswith("-")), None)
    if word is None:
        return f"a command is required: {', '.join(commands.choices)} (h3serve --help says what each does)"
    close = did_you_mean(word, commands.choices)
    hint = f"did you mean {close}?" if close else f"the commands are {', '.join(commands.choices)}"
    return f"{shown(word)} is not an h3serve command; {hint}"


def _stray_flags(parser: argparse.ArgumentParser, tokens: list[str]) -> list[tuple[str, str | None]]:
    """Each flag in `tokens` that `parser` does not have, with the value that follows it (if any); a known flag's
    value is skipped, and nothing after `--` is read."""
    known = parser._option_string_actions
    out: list[tuple[str, str | None]] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--":
            break
        if token.startswith("-") and token != "-" and not NEGATIVE_NUMBER.fullmatch(token):
            flag, equals, value = token.partition("=")
            action = known.get(flag)
            follows = tokens[index + 1] if index + 1 < len(tokens) else None
            if action is None:
                given = value if equals else (follows if follows is not None and not follows.startswith("-") else None)
                out.append((flag, given))
            elif action.nargs != 0 and not equals:
                index += 1  # its value
        index += 1
    return out


def _unknown_flag(parser: Parser, flag: str, value: str | None) -> str:
    """One line for a flag `parser` lacks: what to write instead."""
    if flag in getattr(parser, "not_flags", {}):
        return f"{flag} is not a flag: " + parser.not_flags[flag].format(value=shlex.quote(value or "..."))
    flags = parser._option_string_actions
    for setting in sorted(NO_FLAG):
        if flag == flag_name(setting) and flag_name(f"{setting}_file") in flags:
            config = f" or {setting} in a --config file" if "--config" in flags else ""
            file = flag_name(f"{setting}_file")
            return (
                f"{flag}: the key is never a flag (a command line is visible to every user of the host): set "
                f"{env_name(setting)} in the environment{config}, or give {file} FILE"
            )
    names = [name for name in flags if name.startswith("--")]
    close = did_you_mean(flag.lstrip("-"), [name[2:] for name in names])
    if close is not None:
        return f"{flag} is not a flag of {parser.prog}; did you mean --{close}?"
    return f"{flag} is not a flag of {parser.prog} ({parser.prog} --help lists them)"


# ---- numbers on the command line: ASCII digits, as the settings read them (`errors.whole_number`) --------------------
def whole_arg(text: str) -> int:
    """argparse `type=` for a whole number."""
    try:
        return whole_number(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err}, got {shown(text)}") from None


def decimal_arg(text: str) -> float:
    """argparse `type=` for a number (`1.5`, `2e3`)."""
    try:
        return decimal_number(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err}, got {shown(text)}") from None


def bound_arg(text: str) -> float:
    """argparse `type=` for a number or `inf` (a bound that may be none)."""
    try:
        return decimal_number(text, infinite=True)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err} or inf, got {shown(text)}") from None

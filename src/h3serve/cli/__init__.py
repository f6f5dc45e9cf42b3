"""`h3serve` command line. `render`: a prompt (and optional keyframes) to an MP4 with sound; `serve`, `check`, `ready`
(cli/serve.py); `accept`, `bench` (cli/tools.py); `store check`, `store rebuild` (cli/store.py).

Everything the user gives is checked before any weight loads: the prompt, the keyframe files, the output path, the
profile and the request against the model's rules. Any failure prints one line and exits non-zero, and no partial
output file is left behind (the MP4 is written under a temporary name and renamed when complete). Ctrl-C exits 130
and, during `render`, SIGTERM exits 143, each with one line and by the same unwinding, so neither leaves one either.

The parsers and the quick commands (`--help`, `check` without --preflight, `ready`) import neither torch nor av:
each command imports what it runs.
"""

from __future__ import annotations

import logging
import sys

from h3serve import __version__
from h3serve.cli import render, serve, store, tools
from h3serve.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED, CliError, Parser, parse_command_line
from h3serve.cli.signals import Terminated

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    # Parser: a usage error is answered in a line or two naming what to write instead (`common.parse_command_line`);
    # every subcommand's parser is one too (argparse makes them of the main parser's class).
    parser = Parser(prog="h3serve", description="MiniMax-H3 inference engine")
    parser.add_argument("--version", action="version", version=f"h3serve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    render.add_parser(sub)
    serve.add_parsers(sub)
    tools.add_accept_parser(sub)
    tools.add_bench_parser(sub)
    store.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    command, verbose = "h3serve", False
    # The parse is inside: building the parsers imports the settings (pydantic), where a Ctrl-C may land too.
    # argparse's own exits (--help, --version, a usage error) are SystemExit and pass through.
    try:
        args = parse_command_line(build_parser(), argv)
        command, verbose = args.command, args.verbose
        # A server's log needs times; a one-shot command's does not.
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s" if command == "serve" else "%(levelname)s %(message)s"
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=fmt)
        return args.func(args)
    except CliError as err:
        print(f"h3serve: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("h3serve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("h3serve: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as err:  # an internal failure (out of memory, a bug): still one line, still no partial file
        if verbose:
            logging.exception("h3serve: %s failed", command)
        hint = "" if verbose else " (run with -v for the traceback)"
        print(f"h3serve: error: {command} failed: {type(err).__name__}: {err}{hint}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

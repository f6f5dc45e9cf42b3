"""`h3serve store check` and `h3serve store rebuild`: the job store in H3_OUTPUT_DIR, checked as a start checks it, and
rebuilt from the job records kept beside the MP4s (`service.store`; docs/operators.md, "Job store")."""

from __future__ import annotations

import argparse

from h3serve.cli.common import EXIT_ERROR, CliError, read_settings


def add_parser(sub: argparse._SubParsersAction) -> None:
    from h3serve.settings import add_flags

    p = sub.add_parser(
        "store",
        help="check the job store in the output folder, or rebuild it from the records beside the MP4s",
        description="The job store (H3_OUTPUT_DIR/jobs.sqlite3) and the folder it describes. `check` reports what a "
        "start checks; `rebuild` makes a new store from the records beside the MP4s, with the damaged one kept.",
    )
    # metavar: argparse names a missing subcommand by it, else by its dest (an internal word, "store_command").
    commands = p.add_subparsers(dest="store_command", title="subcommands", metavar="{check,rebuild}", required=True)
    c = commands.add_parser(
        "check",
        allow_abbrev=False,
        help="report the store's integrity, its rows and the files beside it; exit 1 if a start would refuse it",
        description="Read the settings as `serve` does and check the job store in the output folder without changing "
        "it: SQLite's integrity check, its jobs table, every record, the MP4s without a record and the records whose "
        "MP4 is missing. Exit 0 if it is sound, 1 if `serve` would refuse it.",
    )
    add_flags(c)
    c.set_defaults(func=cmd_check)
    r = commands.add_parser(
        "rebuild",
        allow_abbrev=False,
        help="move the store aside (never deleted) and build a new one from the records beside the MP4s",
        description="With the server stopped (it is refused while a server uses the folder, --force or not): move "
        "jobs.sqlite3 aside as jobs.sqlite3.damaged-<UTC time> and build a new store from every finished job's record "
        "in videos/ that passes its checks and every readable row of the old store; MP4s no record names, and records "
        "that were skipped, are moved to unrecorded-<UTC time>/. Nothing is deleted. A sound store is left as it is "
        "unless --force is given.",
    )
    add_flags(r)
    r.add_argument("--force", action="store_true", help="rebuild even when the check finds the store sound")
    r.set_defaults(func=cmd_rebuild)


def cmd_check(args: argparse.Namespace) -> int:
    from h3serve.service.store import inspect_store

    settings = read_settings(args, check_profile=False)  # the store is the output folder's: no hardware asked
    _refuse_postgres(settings)
    report = inspect_store(settings.output_dir, outputs=_bucket(settings))
    for line in report.lines():
        print(line)
    return EXIT_ERROR if report.refusals() else 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from h3serve.service.store import REBUILD, FolderBusy, FolderLock, JobStore, inspect_store, rebuild_store

    settings = read_settings(args, check_profile=False)
    _refuse_postgres(settings)
    output_dir, bucket = settings.output_dir, _bucket(settings)
    if not output_dir.is_dir():
        raise CliError(f"{output_dir}: no such folder (H3_OUTPUT_DIR, --output-dir): nothing to rebuild")
    # The folder's lock, for the whole command: a server finishing or deleting jobs beside a rebuild would have them
    # lost, or brought back, by the swap. A server holding it is never overridden, --force or not.
    try:
        lock = FolderLock(output_dir, REBUILD)
    except FolderBusy as err:
        raise CliError(f"{err}. Nothing was changed: a rebuild never runs beside a server (--force or not)") from err
    with lock:
        before = inspect_store(output_dir, outputs=bucket)
        if not before.refusals() and not args.force:
            print(f"{before.path}: sound, {before.rows} job(s); nothing rebuilt (--force rebuilds it anyway)")
            return 0
        for line in before.lines():
            print(line)
        try:
            rebuilt = rebuild_store(output_dir, lock=lock, outputs=bucket)
        except ValueError as err:  # files.FileRefused: videos/ is no folder; checked before anything changed
            raise CliError(f"{err}. Nothing was changed") from err
        for line in rebuilt.lines(before.path):
            print(line)
        if rebuilt.not_moved:  # a start deletes an MP4 no record names: these must leave videos/ first, by hand
            names = ", ".join(s.name for s in rebuilt.not_moved[:5]) + (", ..." if len(rebuilt.not_moved) > 5 else "")
            raise CliError(
                f"the store is rebuilt, but {len(rebuilt.not_moved)} file(s) no record names could not be moved out "
                f"of videos/ ({names}): move them elsewhere before the next start, which deletes an MP4 without a "
                "record (a render cut short)"
            )
        try:  # opened as a start opens it: checked, and the sidecars of the jobs it marks failed written
            JobStore(output_dir, lock=lock).close()
        except ValueError as err:
            raise CliError(f"the rebuilt store is refused too: {err}") from err
    print(f"{before.path}: rebuilt; `h3serve store check` reports it")
    return 0


def _bucket(settings):
    """H3_OUTPUT_URL's bucket (`store.objects.S3Outputs`), where the MP4s are listed, or None (videos/)."""
    if settings.output_url is None:
        return None
    from h3serve.service.store.objects import S3Outputs

    return S3Outputs.of(settings)


def _refuse_postgres(settings) -> None:
    """`store check` and `store rebuild` are the SQLite store's (its file, the records beside the MP4s); with H3_STORE
    a PostgreSQL database holds the records, checked at each start and restored from its own backups."""
    if settings.store is not None:
        raise CliError(
            "H3_STORE (--store) names a PostgreSQL store: `h3serve store check` and `store rebuild` work on the SQLite "
            "store in the output folder only (not yet on PostgreSQL). `h3serve check --preflight` checks the "
            "database's table and rows as a start does; restore a damaged database from its backups"
        )

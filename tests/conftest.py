"""Fixtures shared by test modules: the PostgreSQL server the job store's tests run against (tests/pg_fixtures.py), one
per session, started on first use (not at all by a run that needs none), and `backend`, each job store in turn."""

from __future__ import annotations

import pytest

from pg_fixtures import Backend, fresh_database, postgres_server


@pytest.fixture(scope="session")
def pg_server():
    """The admin URL of a PostgreSQL server for this session (started here, or H3_TEST_DATABASE_URL)."""
    with postgres_server() as url:
        yield url


@pytest.fixture
def pg_url(pg_server):
    """The URL of a fresh database of its own for one test, dropped after it."""
    with fresh_database(pg_server) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request) -> Backend:
    """Each job store in turn: SQLite in the test's folder, then PostgreSQL in a fresh database of its own."""
    if request.param == "sqlite":
        return Backend("sqlite", None)
    return Backend("postgresql", request.getfixturevalue("pg_url"))

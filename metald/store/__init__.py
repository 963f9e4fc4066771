"""Persistence: SQLModel tables, the engine (SQLite WAL or PostgreSQL) and Alembic migrations."""

from metald.store.db import Store, libpq_conninfo, make_engine

__all__ = ["Store", "libpq_conninfo", "make_engine"]

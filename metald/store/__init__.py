"""Persistence: SQLModel tables, the engine (SQLite WAL or PostgreSQL) and Alembic migrations."""

from metald.store.db import Store, make_engine

__all__ = ["Store", "make_engine"]

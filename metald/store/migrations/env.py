"""Alembic environment: metald passes its engine in; no alembic.ini URL is used."""

from alembic import context
from sqlmodel import SQLModel

import metald.store.models  # noqa: F401  (registers the tables on SQLModel.metadata)

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    engine = context.config.attributes["engine"]
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # Several metald instances may start at once on one database: one migrates,
                # the others wait here and then find the schema current.
                connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7215330912)")
            context.run_migrations()
        connection.commit()


run_migrations_online()

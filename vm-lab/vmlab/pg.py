"""A private, throwaway PostgreSQL server for tests: Debian's binaries, a temp data folder.

Runs as the ``postgres`` user when started by root (PostgreSQL refuses to run as root), listens
on 127.0.0.1 on a free port, and is stopped at the end of the session. Nothing is mocked.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .labnet import free_port


def pg_bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class PgServer:
    def __init__(
        self, listen: str = "127.0.0.1", netns: str | None = None, clients: str = ""
    ) -> None:
        """``listen``: the address it serves on; ``netns``: a network namespace to run it in
        (a lab's attached namespace, so metald instances in other namespaces reach it);
        ``clients``: a CIDR whose hosts may connect without a password, as local ones do."""
        bindir = pg_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL binaries not found (Debian package 'postgresql')")
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="metald-pg-"))
        self.data = self.dir / "data"
        self.listen, self.netns = listen, netns
        self._migrated: str | None = None
        self.port = free_port() if netns is None else 5432
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run(
            [
                "initdb",
                "-D",
                str(self.data),
                "-U",
                "metald",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ]
        )
        if clients:
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {clients} trust\n")
        opts = f"-c listen_addresses={listen} -p {self.port} -k {self.dir} -c fsync=off -c max_connections=200"
        self._run(
            [
                "pg_ctl",
                "-D",
                str(self.data),
                "-o",
                opts,
                "-l",
                str(self.dir / "log"),
                "-w",
                "start",
            ],
            netns=netns,
        )
        for _ in range(100 if netns is None else 0):  # in a namespace, pg_ctl -w has waited
            try:
                socket.create_connection((listen, self.port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)

    def _run(self, argv: list[str], netns: str | None = None) -> None:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        if netns is not None:
            cmd = ["nsenter", f"--net=/run/netns/{netns}", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, cwd="/")

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://metald@{self.listen}:{self.port}/postgres"

    def new_database(self, template: str | None = None) -> str:
        """A new database, empty, or a copy of the database ``template`` (which nobody may be
        connected to: PostgreSQL copies its files)."""
        name = "t_" + uuid.uuid4().hex[:12]
        clause = f' TEMPLATE "{template}"' if template else ""
        with self._admin() as c:
            if template and c.info.server_version >= 150000:
                # PostgreSQL 15's default copies a template block by block through the WAL:
                # 0.26 s for the migrated ~10 MB one, against 0.08 s for a file copy (fsync is
                # off here, so the copy's checkpoints cost little), on every test's setup.
                clause += " STRATEGY FILE_COPY"
            c.execute(f'CREATE DATABASE "{name}"{clause}')
        return f"postgresql+psycopg://metald@{self.listen}:{self.port}/{name}"

    def drop_database(self, url: str) -> None:
        """Drop a database ``new_database`` made, closing whatever is still connected to it
        (a test's leftover pool): its ~10 MB would otherwise stay until ``stop``."""
        name = url.rsplit("/", 1)[1].split("?", 1)[0]
        with self._admin() as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _admin(self) -> Any:
        """An autocommit connection to the ``postgres`` database over the Unix socket (it
        works from any network namespace)."""
        import psycopg

        return psycopg.connect(
            f"host={self.dir} port={self.port} user=metald dbname=postgres", autocommit=True
        )

    def migrated_template(self) -> str:
        """The name of a database migrated to head, made on first use: ``new_database(template=
        ...)`` copies it in milliseconds where migrating a new one runs every migration."""
        if self._migrated is None:
            from metald.store import Store

            url = self.new_database()
            store = Store(url)
            try:
                store.migrate()
            finally:
                store.close()
            self._migrated = url.rsplit("/", 1)[1]
        return self._migrated

    def local_url(self, database: str) -> str:
        """A URL for this host's processes (the Unix socket), whatever namespace it is in."""
        return f"postgresql+psycopg://metald@/{database}?host={self.dir}&port={self.port}"

    def stop(self) -> None:
        try:
            self._run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

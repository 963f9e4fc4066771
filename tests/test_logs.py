"""Secrets never reach the log: whole formatted records are redacted, tracebacks included."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest
from aiohttp import web

from metald.logs import setup_logging

TOKEN = "mtd_" + "Q7x-" * 10


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_oversized_authorization_header_is_not_logged(fmt, capsys, restore_logging) -> None:  # type: ignore[no-untyped-def]
    """A 9 KB Authorization header makes aiohttp's parser log a traceback that quotes the
    header: the token in it is redacted, in text and JSON logs alike."""
    setup_logging("info", fmt)
    app = web.Application()
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(
            b"GET /api/v1/whoami HTTP/1.1\r\nHost: metald\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"A" * 9000
            + b"\r\n\r\n"
        )
        assert (await asyncio.wait_for(reader.read(), 20)).startswith(b"HTTP/1.0 400")
        writer.close()
    finally:
        await runner.cleanup()
    err = capsys.readouterr().err
    assert "Got more than" in err  # the traceback was logged ...
    assert TOKEN[:12] not in err and "AAAAAAAA" not in err  # ... without the credential
    if fmt == "json":
        assert all(json.loads(line) for line in err.splitlines() if line)


def test_secrets_in_arguments_and_exceptions_are_redacted(capsys, restore_logging) -> None:  # type: ignore[no-untyped-def]
    setup_logging("info", "text")
    log = logging.getLogger("metald.test")
    try:
        raise ValueError(f"bad header Authorization: Bearer {TOKEN} password=hunter2")
    except ValueError:
        log.exception("request failed for %s", {"token": TOKEN})
    log.warning("stack with a secret %s", "passwd: s3cr3t", stack_info=True)
    err = capsys.readouterr().err
    assert "request failed" in err and "ValueError" in err
    for secret in (TOKEN, "hunter2", "s3cr3t", TOKEN[4:16]):
        assert secret not in err

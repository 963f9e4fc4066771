"""``metalctl machines console ID``: attach this terminal to a machine's serial console.

The terminal goes to raw mode (every key goes to the machine, Ctrl-C included); escapes work
as in ssh and ipmitool, after Enter: ``~.`` leaves, ``~B`` sends a serial break, ``~~`` sends
one ``~``, ``~?`` lists them. ``--read-only`` watches without typing; the first viewer
otherwise becomes the writer, and later ones read (the API says who writes).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import termios
import tty
from collections.abc import Callable
from typing import Any, BinaryIO
from urllib.parse import quote

from . import wsclient
from .client import Client

HELP = (
    b"\r\nSupported escapes (after Enter):\r\n"
    b"  ~.  leave the console\r\n  ~B  send a serial break\r\n"
    b"  ~~  send one ~\r\n  ~?  this help\r\n"
)


def add_to(msub: Any) -> None:
    mc = msub.add_parser("console", help="attach this terminal to the machine's serial console")
    mc.add_argument("id", help="id, name or id prefix")
    mode = mc.add_mutually_exclusive_group()
    mode.add_argument("--read-only", dest="mode", action="store_const", const="read")
    mode.add_argument(
        "--write", dest="mode", action="store_const", const="write", help="fail if someone writes"
    )
    mc.set_defaults(func=console, mode="auto")


class EscapeParser:
    """ssh's escape rule: ``~`` is special only as the first key of a line."""

    def __init__(self) -> None:
        self.line_start = True
        self.tilde = False

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        """Actions for typed bytes: ("send", bytes), ("break"|"quit"|"help", b"")."""
        out: list[tuple[str, bytes]] = []
        buf = bytearray()

        def flush() -> None:
            if buf:
                out.append(("send", bytes(buf)))
                buf.clear()

        for b in data:
            ch = bytes([b])
            if self.tilde:
                self.tilde = False
                if ch == b".":
                    flush()
                    out.append(("quit", b""))
                    return out
                if ch in (b"B", b"b"):
                    flush()
                    out.append(("break", b""))
                    self.line_start = False
                    continue
                if ch == b"?":
                    flush()
                    out.append(("help", b""))
                    continue
                buf += b"~" if ch == b"~" else b"~" + ch
                self.line_start = ch in (b"\r", b"\n")
                continue
            if self.line_start and ch == b"~":
                self.tilde = True
                continue
            buf += ch
            self.line_start = ch in (b"\r", b"\n")
        flush()
        return out


def console(args: argparse.Namespace, c: Client) -> int:
    machine = c.call("GET", f"/api/v1/machines/{quote(args.id, safe='')}")["id"]
    url = f"{c.url}/api/v1/machines/{machine}/console?mode={args.mode}"
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setraw(fd)
        return attach(
            url, c.token, fd, sys.stdout.buffer, note=lambda s: _note(s, saved is not None)
        )
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _note(text: str, raw: bool) -> None:
    sys.stderr.write(f"[metalctl: {text}]" + ("\r\n" if raw else "\n"))
    sys.stderr.flush()


def attach(
    url: str,
    token: str | None,
    in_fd: int,
    out: BinaryIO,
    *,
    note: Callable[[str], None],
) -> int:
    """Carry ``in_fd``'s bytes to the console and its output to ``out`` until ``~.``, the end
    of input, or the server closing; returns the exit status."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        ws = wsclient.connect(url, headers)
    except wsclient.WsRefused as e:
        note(f"the console was refused: {e}")
        return 1
    except (OSError, wsclient.WsError) as e:
        note(f"cannot open the console: {e}")
        return 2
    esc = EscapeParser()
    try:
        while True:
            ready = [ws] if ws.pending() else select.select([ws, in_fd], [], [])[0]
            if ws in ready:
                for m in ws.receive():
                    if m.opcode == wsclient.OP_BINARY:
                        out.write(m.data)
                        out.flush()
                    elif m.opcode == wsclient.OP_TEXT:
                        _show_note(json.loads(m.data), note)
                    elif m.opcode == wsclient.OP_CLOSE:
                        note("metald closed the console")
                        return 0
            if in_fd in ready:
                data = os.read(in_fd, 4096)
                if not data:
                    break
                for action, payload in esc.feed(data):
                    if action == "send":
                        ws.send_bytes(payload)
                    elif action == "break":
                        ws.send_json({"type": "break"})
                    elif action == "help":
                        out.write(HELP)
                        out.flush()
                    else:
                        note("left the console")
                        return 0
    except (OSError, wsclient.WsError) as e:
        note(f"the console connection broke: {e}")
        return 2
    finally:
        ws.close()
    return 0


def _show_note(n: dict[str, Any], note: Callable[[str], None]) -> None:
    kind = n.get("type")
    if kind == "hello":
        who = f"; {n['writer']} writes" if n.get("writer") and n.get("mode") == "read" else ""
        note(f"attached ({n.get('mode')}{who}); ~. leaves, ~? lists escapes")
    elif kind == "status":
        note(f"console {n.get('state')}" + (f": {n['detail']}" if n.get("detail") else ""))
    elif kind in ("error", "closed"):
        note(str(n.get("detail")))

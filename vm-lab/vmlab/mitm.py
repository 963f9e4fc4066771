"""A man in the middle's HTTPS server for labs: ``python -m vmlab.mitm PORT CERT KEY LOG``.

It answers every TCP connection on PORT with TLS under CERT (a certificate metald's CA did not
issue), and writes one line per connection to LOG: ``handshake-failed <why>`` when the client
refused the certificate, else ``request <first line>`` with whatever the client sent first (a
token, if it had one to give). It answers every request 404. Labs redirect metald's HTTPS port
to it (nftables) to play a second server answering metald's address.
"""

from __future__ import annotations

import socket
import ssl
import sys
import threading
from pathlib import Path


def _serve(conn: socket.socket, ctx: ssl.SSLContext, log: Path, lock: threading.Lock) -> None:
    def note(line: str) -> None:
        with lock, open(log, "a") as f:
            f.write(line + "\n")

    conn.settimeout(30)
    try:
        tls = ctx.wrap_socket(conn, server_side=True)
    except (ssl.SSLError, OSError) as e:
        note(f"handshake-failed {type(e).__name__}: {e}")
        conn.close()
        return
    try:
        data = tls.recv(65536)
        first = data.split(b"\r\n", 1)[0].decode("latin-1")
        note(f"request {first} ({len(data)} bytes)")
        tls.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    except (ssl.SSLError, OSError) as e:
        note(f"after-handshake {type(e).__name__}: {e}")
    finally:
        tls.close()


def main(port: int, cert: str, key: str, log: Path) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    lock = threading.Lock()
    srv = socket.create_server(("0.0.0.0", port), reuse_port=False)
    log.touch()
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve, args=(conn, ctx, log, lock), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]))

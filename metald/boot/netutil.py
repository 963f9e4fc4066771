"""Socket helpers shared by the DHCP, TFTP and RA shells (Linux only)."""

from __future__ import annotations

import socket

SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def udp_socket(
    host: str, port: int, *, interface: str = "", broadcast: bool = False
) -> socket.socket:
    """A non-blocking UDP socket; with ``interface`` it only sees and sends on that device,
    so several interfaces can each hold the same port and nothing arrives from elsewhere."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if broadcast:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        if interface:
            s.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, interface.encode())
        # A rack powering on bursts; a deep receive queue absorbs it instead of dropping.
        # SO_RCVBUF is capped by net.core.rmem_max (~200 KB by default, a few hundred
        # packets); as root (which port 67 needs anyway) SO_RCVBUFFORCE is not.
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 << 20)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.setblocking(False)
        s.bind((host, port))
    except BaseException:
        s.close()
        raise
    return s

"""The C extensions, beside pyproject.toml (which holds everything else).

metald.boot.tftp._fastack is the TFTP server's lock-step ACK loop, metald.boot.dhcp._batchio
the DHCP server's batched socket I/O (recvmmsg, sendmmsg), metald.boot.dhcp._codec its reply
encoder; bench/BOOT.md says why each is C.
Both are optional: where they cannot be built (no compiler or Python headers), the install
goes on and each server uses its pure-Python path, chosen at import
(metald/boot/tftp/server.py, metald/boot/dhcp/server.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "metald.boot.tftp._fastack",
            ["metald/boot/tftp/_fastack.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=vla"],
        ),
        Extension(
            "metald.boot.dhcp._batchio",
            ["metald/boot/dhcp/_batchio.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=vla"],
        ),
        Extension(
            "metald.boot.dhcp._codec",
            ["metald/boot/dhcp/_codec.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=vla"],
        ),
    ]
)

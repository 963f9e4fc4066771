"""The one C extension, beside pyproject.toml (which holds everything else).

metald.boot.tftp._fastack is the TFTP server's lock-step ACK loop (bench/BOOT.md says why it
is C). It is optional: where it cannot be built (no compiler or Python headers), the install
goes on and the server uses its pure-Python path, chosen at import (metald/boot/tftp/server.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "metald.boot.tftp._fastack",
            ["metald/boot/tftp/_fastack.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=vla"],
        )
    ]
)

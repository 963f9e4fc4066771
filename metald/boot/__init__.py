"""The boot plane: DHCPv4 (full and proxy), TFTP, HTTP boot and IPv6 Router Advertisements.

Protocol logic lives in pure modules (bytes in, decisions out); asyncio shells do the I/O.
Everything that touches the rest of metald goes through ``metald.boot.hooks.BootHooks``.
"""

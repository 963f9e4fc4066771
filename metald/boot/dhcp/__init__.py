"""DHCPv4: codec (``packet``), decision handlers (``full``, ``proxy``), asyncio shell (``server``)."""

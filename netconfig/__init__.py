"""Host networking with pyroute2: namespaces, veths, addresses, WireGuard devices."""

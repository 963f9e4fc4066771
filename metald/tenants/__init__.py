"""Tenant clusters: WireGuard hubs, overlay addresses, one-time joins, scheduler join material."""

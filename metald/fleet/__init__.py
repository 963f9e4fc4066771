"""Several metald instances as one system: who is alive, and who owns what.

PostgreSQL is the only coordination point (no consensus of metald's own). Each instance
records itself in the store and heartbeats; ownership of a BMC (and later hubs and sweeps)
follows a rendezvous hash over the live instances that may own it, so an instance joining or
leaving moves about 1/N of the objects. See docs/fleet.md.
"""

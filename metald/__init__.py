"""metald: a bare-metal provisioning daemon for GPU fleets."""

__version__ = "0.1.0"

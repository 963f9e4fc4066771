"""Fixtures for the health watch tests: a real ipmi_sim BMC per test."""

from tests.bmc.peers import ipmi_sim  # noqa: F401

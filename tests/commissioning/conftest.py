"""Fixtures the commissioning tests share with the BMC tests: a real ipmi_sim per test."""

from tests.bmc.peers import ipmi_sim  # noqa: F401

"""Fixtures for the health watch tests: a real ipmi_sim BMC per test, the lab Redfish BMC."""

from tests.bmc.peers import ipmi_sim, lab_redfish  # noqa: F401

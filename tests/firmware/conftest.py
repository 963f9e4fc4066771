"""Fixtures for the firmware tests: the BMC tests' real peers."""

from tests.bmc.peers import lab_redfish, sushy  # noqa: F401

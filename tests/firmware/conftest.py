"""Fixtures for the firmware tests: the BMC tests' real peers, and metald over the lab BMC."""

from tests.bmc.peers import lab_redfish, sushy  # noqa: F401
from tests.firmware.lab import env  # noqa: F401

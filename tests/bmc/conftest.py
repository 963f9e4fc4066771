"""Fixtures for the BMC tests: real peers, started per test (see ``peers``)."""

from tests.bmc.peers import fault_bmc, ipmi_sim, sushy, sushy_auth, sushy_slow, sushy_tls  # noqa: F401

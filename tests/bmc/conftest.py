"""Fixtures for the BMC tests: real peers, started per test (see ``peers``)."""

from tests.bmc.peers import (  # noqa: F401
    fault_bmc,
    ipmi_sim,
    lab_redfish,
    sushy,
    sushy_auth,
    sushy_slow,
    sushy_tls,
)

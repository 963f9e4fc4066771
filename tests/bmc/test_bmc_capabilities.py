"""Each driver implements the capability interfaces it advertises, and nothing it does not
advertise: a command for a missing capability is refused by name (``CapabilityMissing``), never
a method that happens to exist."""

from __future__ import annotations

import inspect

import pytest

from metald.bmc.capabilities import INTERFACES, Capability, CapabilityMissing
from metald.bmc.executor import DRIVERS, capabilities_of


def _methods(interface: type) -> set[str]:
    return {n for n, v in vars(interface).items() if inspect.isfunction(v) and n[0] != "_"}


@pytest.mark.parametrize("protocol", sorted(DRIVERS))
def test_a_driver_implements_exactly_what_it_advertises(protocol: str) -> None:
    driver = DRIVERS[protocol]
    assert set(INTERFACES) == set(Capability)
    for capability, interface in INTERFACES.items():
        has = {name for name in _methods(interface) if callable(getattr(driver, name, None))}
        if capability in driver.capabilities:
            assert has == _methods(interface), f"{protocol} lacks part of {capability}"
        else:
            assert not has, f"{protocol} has {sorted(has)} but does not advertise {capability}"


def test_what_each_protocol_offers() -> None:
    assert capabilities_of("ipmi") == {
        Capability.POWER,
        Capability.BOOT_DEVICE,
        Capability.INDICATOR,
        Capability.SENSORS,
        Capability.EVENT_LOG,
        Capability.SERIAL_CONSOLE,
    }
    assert capabilities_of("redfish") == {
        Capability.POWER,
        Capability.BOOT_DEVICE,
        Capability.INDICATOR,
        Capability.SENSORS,
        Capability.EVENT_LOG,
        Capability.EVENT_PUSH,
        Capability.FIRMWARE,
        Capability.FIRMWARE_UPDATE,
        Capability.ACCOUNTS,
        Capability.BIOS,
        Capability.SECURE_BOOT,
        Capability.VIRTUAL_MEDIA,
    }
    assert capabilities_of("snmp") == frozenset()


def test_the_refusal_names_the_capability_and_what_is_offered() -> None:
    e = CapabilityMissing("b1", "ipmi", Capability.FIRMWARE, capabilities_of("ipmi"), "try x")
    assert e.status == 422
    assert e.extra == {"bmc_id": "b1", "capability": "firmware"}
    assert e.detail == (
        "BMC b1 speaks ipmi, which has no firmware capability (it offers: boot-device, "
        "event-log, indicator, power, sensors, serial-console); try x"
    )

"""The inventory payload the discovery agent posts: schema version 1.

Strict on purpose: unknown keys, wrong types, oversized strings and lists are refused with an
error naming the field, so a malformed or hostile post never reaches the store. Vendor tool
output travels verbatim in ``raw`` (bounded in size) and is interpreted by ``normalize``.
``boot_id`` (the kernel's random per-boot id) and ``sequence`` (counts up with every post of
that boot) let metald refuse replayed posts; see ``check_replay``. docs/inventory.md describes
every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from metald.errors import Conflict, Forbidden, Unprocessable

SCHEMA_VERSION = 1
#: Boot ids remembered per machine; a post from an older boot than these is refused.
REPLAY_WINDOW = 16

Text = Annotated[str, Field(max_length=256)]
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:@-]+$")]
Hex16 = Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{4}$")]
Mac = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")]
PciAddress = Annotated[
    str, Field(pattern=r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
]
Count = Annotated[int, Field(ge=0, le=1 << 20)]


class InventoryError(Unprocessable):
    title = "Invalid inventory"


class ReplayedInventory(Conflict):
    title = "Replayed inventory"


class WrongMachine(Forbidden):
    title = "Inventory for another machine"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class SystemInfo(_Strict):
    """SMBIOS/DMI strings, as /sys/class/dmi/id gives them (placeholders are cleaned later)."""

    vendor: Text | None = None
    product: Text | None = None
    serial: Text | None = None
    uuid: Text | None = None
    sku: Text | None = None
    family: Text | None = None
    board_vendor: Text | None = None
    board_product: Text | None = None
    board_serial: Text | None = None
    chassis_serial: Text | None = None
    bios_vendor: Text | None = None
    bios_version: Text | None = None


class Midr(_Strict):
    """An arm64 CPU's identity (its MIDR_EL1 register), as /proc/cpuinfo's first CPU shows it
    ("CPU implementer", "CPU variant", "CPU part", "CPU revision") and as sysfs gives the whole
    register (``/sys/devices/system/cpu/cpu0/regs/identification/midr_el1``)."""

    implementer: Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{1,2}$")] | None = None
    variant: Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]$")] | None = None
    part: Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{1,3}$")] | None = None
    revision: Annotated[str, Field(pattern=r"^[0-9]{1,2}$")] | None = None
    midr_el1: Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{1,16}$")] | None = None


class CpuInfo(_Strict):
    #: /proc/cpuinfo's "model name" (x86; arm64 kernels print none).
    model: Text | None = None
    #: ``uname -m``: x86_64, aarch64 (agents before arm64 did not send it).
    arch: Text | None = None
    #: arm64: the MIDR fields metald names the core from (``metald.inventory.cpuname``).
    midr: Midr | None = None
    #: The first SMBIOS processor structure (type 4), raw bytes in hex, as the kernel exposes
    #: it (/sys/firmware/dmi/entries/4-0/raw): its processor version string names the CPU.
    smbios_type4: Annotated[str, Field(max_length=2048, pattern=r"^([0-9a-f]{2})*$")] | None = None
    #: Logical CPUs (threads) the kernel sees.
    logical: Count
    #: Distinct "physical id" values in /proc/cpuinfo.
    sockets: Count | None = None
    #: Physical cores over all sockets ("cpu cores" summed per socket).
    cores: Count | None = None


class MemoryInfo(_Strict):
    #: MemTotal from /proc/meminfo (what the kernel manages; less than what is installed).
    meminfo_total_kb: Annotated[int, Field(ge=0, le=1 << 40)] | None = None
    #: Online memory blocks x block size from /sys/devices/system/memory: closer to installed RAM.
    online_bytes: Annotated[int, Field(ge=0, le=1 << 52)] | None = None


class Disk(_Strict):
    name: Name
    size_bytes: Annotated[int, Field(ge=0, le=1 << 60)]
    model: Text | None = None
    serial: Text | None = None
    wwn: Text | None = None
    #: /dev/disk/by-path name (``pci-0000:00:04.0``), where the agent can tell it exactly.
    by_path: Text | None = None
    rotational: bool | None = None
    removable: bool | None = None


class Nic(_Strict):
    name: Name
    mac: Mac
    driver: Text | None = None
    #: Carrier present.
    link: bool | None = None
    #: /sys/class/net/X/speed; null when unknown (no link, virtual device).
    speed_mbps: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    pci_address: PciAddress | None = None


class PciDevice(_Strict):
    address: PciAddress
    vendor: Hex16
    device: Hex16
    #: 24-bit class code, as sysfs writes it (0x030200).
    class_: Annotated[str, Field(alias="class", pattern=r"^0x[0-9a-fA-F]{6}$")]
    subsystem_vendor: Hex16 | None = None
    subsystem_device: Hex16 | None = None
    driver: Text | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class IbPort(_Strict):
    """An RDMA port from /sys/class/infiniband/DEV/ports/N: its GUID is the lower 64 bits of
    GID 0 (what the subnet manager and ``ibnetdiscover`` name it by)."""

    device: Name
    port: Annotated[int, Field(ge=1, le=255)]
    port_guid: Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{16}$")]
    node_guid: Annotated[str, Field(pattern=r"^0x[0-9a-fA-F]{16}$")] | None = None
    #: InfiniBand or Ethernet (RoCE ports have GUIDs too, but no subnet manager).
    link_layer: Annotated[str, Field(max_length=16)] | None = None
    #: ``4: ACTIVE``, as sysfs writes it.
    state: Annotated[str, Field(max_length=32)] | None = None
    #: ``400 Gb/sec (4X NDR)``, as sysfs writes it.
    rate: Annotated[str, Field(max_length=64)] | None = None


class RawOutputs(_Strict):
    """Verbatim vendor tool output, when the tool is in the image and works. Each is optional."""

    #: ``nvidia-smi -q -x``
    nvidia_smi_xml: Annotated[str, Field(max_length=768 * 1024)] | None = None
    #: ``nvidia-smi nvlink -s``: each GPU's NVLink links, their speed or inactive
    nvidia_smi_nvlink: Annotated[str, Field(max_length=256 * 1024)] | None = None
    #: ``nvidia-smi topo -m``: the GPU/NIC connection matrix (NV#, PIX, SYS, ...)
    nvidia_smi_topo: Annotated[str, Field(max_length=64 * 1024)] | None = None
    #: ``rocm-smi --showproductname --showbus --showserial --json`` (or a superset of it)
    rocm_smi_json: Annotated[str, Field(max_length=256 * 1024)] | None = None
    #: ``ipmitool lan print`` (BMC address, MAC, address source)
    ipmitool_lan_print: Annotated[str, Field(max_length=16 * 1024)] | None = None
    #: ``lldpctl -f keyvalue`` (switch and port each NIC is cabled to)
    lldpctl: Annotated[str, Field(max_length=64 * 1024)] | None = None


class InventoryPayload(_Strict):
    schema_version: Literal[1]
    agent_version: Annotated[str, Field(max_length=32)]
    #: The machine id from the kernel command line; must match the token's machine when set.
    machine_id: Annotated[str, Field(max_length=64)] | None = None
    #: /proc/sys/kernel/random/boot_id: random, new on every boot.
    boot_id: Annotated[
        str, Field(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    ]
    #: 1 for the first post of a boot, +1 for each later post (retries included).
    sequence: Annotated[int, Field(ge=1, le=1 << 31)]
    system: SystemInfo
    cpu: CpuInfo
    memory: MemoryInfo
    disks: Annotated[list[Disk], Field(max_length=256)] = []
    nics: Annotated[list[Nic], Field(max_length=256)] = []
    pci: Annotated[list[PciDevice], Field(max_length=4096)] = []
    infiniband: Annotated[list[IbPort], Field(max_length=64)] = []
    raw: RawOutputs = RawOutputs()


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{loc or '(payload)'}: {msg}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_payload(data: Any) -> InventoryPayload:
    """Validate a decoded JSON body. Raises ``InventoryError`` naming the first bad fields."""
    if not isinstance(data, dict):
        raise InventoryError("inventory must be a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InventoryError(
            f"schema_version: this metald reads version {SCHEMA_VERSION}, got {version!r}",
            supported=[SCHEMA_VERSION],
        )
    try:
        return InventoryPayload.model_validate(data)
    except ValidationError as e:
        raise InventoryError(f"invalid inventory: {_describe(e)}") from None


def check_machine(payload: InventoryPayload, token_machine_id: str) -> None:
    """Refuse a payload naming a machine other than the one the agent token is scoped to."""
    if payload.machine_id is not None and payload.machine_id != token_machine_id:
        raise WrongMachine(
            f"inventory names machine {payload.machine_id!r} but the token belongs to "
            f"machine {token_machine_id!r}"
        )


class ReplayState(_Strict):
    """What metald remembers per machine to refuse replays: stored with the inventory."""

    boot_id: str
    sequence: int
    #: Earlier boot ids, newest last, at most REPLAY_WINDOW.
    previous_boots: list[str] = []


def check_replay(
    state: ReplayState | dict[str, Any] | None, payload: InventoryPayload
) -> ReplayState:
    """Accept a post only if it is newer than everything seen; return the state to store.

    Same boot: the sequence must grow. New boot: its id must not be one seen before. A replayed
    post (same boot id and sequence, or an older one) raises ``ReplayedInventory``.
    """
    if state is None:
        return ReplayState(boot_id=payload.boot_id, sequence=payload.sequence)
    if isinstance(state, dict):
        state = ReplayState.model_validate(state)
    if payload.boot_id == state.boot_id:
        if payload.sequence <= state.sequence:
            raise ReplayedInventory(
                f"inventory sequence {payload.sequence} of boot {payload.boot_id} is not newer "
                f"than the last accepted ({state.sequence}): a replay or a duplicate",
                boot_id=payload.boot_id,
                sequence=payload.sequence,
            )
        return state.model_copy(update={"sequence": payload.sequence})
    if payload.boot_id in state.previous_boots:
        raise ReplayedInventory(
            f"inventory from an earlier boot ({payload.boot_id}): a replay",
            boot_id=payload.boot_id,
        )
    previous = [*state.previous_boots, state.boot_id][-REPLAY_WINDOW:]
    return ReplayState(boot_id=payload.boot_id, sequence=payload.sequence, previous_boots=previous)

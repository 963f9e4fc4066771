"""A machine's NVLink link matrix, from the two ``nvidia-smi`` views the discovery agent sends:

- ``nvidia-smi nvlink -s`` (``parse_nvlink_status``): per GPU its links and their speed, or
  ``<inactive>``; a GPU whose links are all down says so on a line of its own ("NVML: Unable to
  retrieve NVLink information as all links are inActive").
- ``nvidia-smi topo -m`` (``parse_topo_matrix``): how each GPU reaches every other GPU and NIC:
  ``NV#`` (a bonded set of # NVLinks), ``PIX``/``PXB``/``PHB``/``NODE``/``SYS`` (PCIe paths of
  growing length), ``X`` (itself), with each GPU's CPU and NUMA affinity and the NIC legend
  (``NIC0: mlx5_0``). Terminals get the header underlined (``ESC[4m``); the agent drops the
  ESC byte, so a header may start with ``[4m``.

``links_facts`` joins them: the GPU pairs joined by NVLink and how many links each, per GPU its
active and inactive links and bandwidth, the whole matrix. Both parsers are strict about
shape and ignore what they do not know, so a new nvidia-smi line never breaks an inventory.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

_ANSI = re.compile(r"(?:\x1b)?\[[0-9;]*m")
_GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?\s*$")
_LINK = re.compile(r"^\s*Link (\d+): (.*?)\s*$")
_SPEED = re.compile(r"^([0-9.]+) GB/s$")
_NV = re.compile(r"^NV(\d+)$")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class GpuLinks(_Model):
    index: int
    name: str | None = None
    uuid: str | None = None
    #: Links nvidia-smi listed (0 when it said all are inactive)
    links: int = 0
    #: Links with a speed (up)
    active: int = 0
    #: Link numbers listed as <inactive>
    inactive: list[int] = []
    #: nvidia-smi: "all links are inActive" for this GPU
    all_inactive: bool = False
    #: The speed of its active links (GB/s per link, as nvidia-smi prints it) and their sum
    gbps_per_link: float | None = None
    total_gbps: float = 0.0


class TopoMatrix(_Model):
    #: Column order: GPUs then NICs as nvidia-smi names them (GPU0, NIC0 / mlx5_0)
    devices: list[str] = []
    #: row -> column -> connection ("X", "NV18", "PIX", "SYS", ...)
    cells: dict[str, dict[str, str]] = {}
    cpu_affinity: dict[str, str] = {}
    numa_affinity: dict[str, str] = {}
    #: The NIC legend: NIC0 -> mlx5_0
    nic_names: dict[str, str] = {}


class NvlinkPair(_Model):
    a: str
    b: str
    #: Bonded NVLinks between them (topo -m's NV#)
    links: int


class NvlinkLinks(_Model):
    """The link matrix of one machine, as the inventory keeps it."""

    gpus: list[GpuLinks] = []
    matrix: TopoMatrix | None = None
    #: GPU pairs joined by NVLink, each once (a < b in the matrix's order)
    pairs: list[NvlinkPair] = []
    #: Per GPU, the NIC(s) nearest it (PIX, else PXB): GPU-direct RDMA paths
    nearest_nics: dict[str, list[str]] = {}


def parse_nvlink_status(text: str) -> list[GpuLinks]:
    """``nvidia-smi nvlink -s``: one entry per "GPU n:" block, in order."""
    gpus: list[dict[str, object]] = []
    for line in _ANSI.sub("", text).splitlines():
        if m := _GPU.match(line):
            gpus.append(
                {
                    "index": int(m[1]),
                    "name": m[2] or None,
                    "uuid": m[3],
                    "speeds": [],
                    "inactive": [],
                    "all": False,
                }
            )
            continue
        if not gpus:
            continue
        cur = gpus[-1]
        if "all links are inactive" in line.lower():
            cur["all"] = True
        elif m := _LINK.match(line):
            n, state = int(m[1]), m[2]
            if s := _SPEED.match(state):
                cur["speeds"].append(float(s[1]))  # type: ignore[attr-defined]
            else:
                cur["inactive"].append(n)  # type: ignore[attr-defined]
    out = []
    for g in gpus:
        speeds: list[float] = g["speeds"]  # type: ignore[assignment]
        inactive: list[int] = g["inactive"]  # type: ignore[assignment]
        out.append(
            GpuLinks(
                index=g["index"],  # type: ignore[arg-type]
                name=g["name"],  # type: ignore[arg-type]
                uuid=g["uuid"],  # type: ignore[arg-type]
                links=len(speeds) + len(inactive),
                active=len(speeds),
                inactive=inactive,
                all_inactive=bool(g["all"]),
                gbps_per_link=max(speeds) if speeds else None,
                total_gbps=round(sum(speeds), 3),
            )
        )
    return out


def _split(line: str, header: bool) -> list[str]:
    """A matrix line's fields: nvidia-smi separates them with tabs; a copy that lost them
    (pasted into a web page) has runs of spaces, two or more between header names (which
    hold single spaces: "CPU Affinity")."""
    if "\t" in line:
        return [p.strip() for p in line.strip("\n").split("\t")]
    return re.split(r"\s{2,}" if header else r"\s+", line.strip())


def parse_topo_matrix(text: str) -> TopoMatrix | None:
    """``nvidia-smi topo -m``: None when there is no matrix header (GPU0 ...)."""
    lines = [_ANSI.sub("", ln) for ln in text.splitlines()]
    header = next((i for i, ln in enumerate(lines) if re.match(r"^\s*GPU0\s", ln)), None)
    if header is None:
        return None
    columns = [c for c in _split(lines[header], True) if c]
    devices = [c for c in columns if re.fullmatch(r"(GPU|NIC)\d+|[a-z][a-z0-9]*_\d+", c)]
    rest = columns[len(devices) :]
    cells: dict[str, dict[str, str]] = {}
    cpu: dict[str, str] = {}
    numa: dict[str, str] = {}
    for ln in lines[header + 1 :]:
        if not ln.strip():
            break
        parts = _split(ln, False)
        row, values = parts[0], parts[1:]
        if row not in devices:
            continue
        cells[row] = {d: v for d, v in zip(devices, values, strict=False) if v}
        named = dict(zip(rest, values[len(devices) :], strict=False))
        if named.get("CPU Affinity"):
            cpu[row] = named["CPU Affinity"]
        if named.get("NUMA Affinity"):
            numa[row] = named["NUMA Affinity"]
    legend = {m[1]: m[2] for ln in lines if (m := re.match(r"^\s*(NIC\d+): (\S+)\s*$", ln))}
    return TopoMatrix(
        devices=devices, cells=cells, cpu_affinity=cpu, numa_affinity=numa, nic_names=legend
    )


def links_facts(nvlink_status: str | None, topo: str | None) -> NvlinkLinks | None:
    """The machine's link matrix from whichever of the two outputs it has; None with
    neither (no NVIDIA GPU, or no nvidia-smi in the image)."""
    gpus = parse_nvlink_status(nvlink_status) if nvlink_status else []
    matrix = parse_topo_matrix(topo) if topo else None
    if not gpus and matrix is None:
        return None
    pairs: list[NvlinkPair] = []
    nearest: dict[str, list[str]] = {}
    if matrix is not None:
        order = {d: i for i, d in enumerate(matrix.devices)}
        for a, row in matrix.cells.items():
            if not a.startswith("GPU"):
                continue
            for b, v in row.items():
                m = _NV.match(v)
                if m and b.startswith("GPU") and order[a] < order[b]:
                    pairs.append(NvlinkPair(a=a, b=b, links=int(m[1])))
            nics = [d for d in matrix.devices if not d.startswith("GPU")]
            for level in ("PIX", "PXB"):
                near = [matrix.nic_names.get(n, n) for n in nics if row.get(n) == level]
                if near:
                    nearest[a] = near
                    break
    return NvlinkLinks(gpus=gpus, matrix=matrix, pairs=pairs, nearest_nics=nearest)

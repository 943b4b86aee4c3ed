"""The links GPUs talk over, as NCCL's topology counts them, and the node each --gpu comes in.

Bandwidths are GB/s (1e9 B/s) one GPU moves in one direction, the figure NCCL's topology detection
gives the link (NVIDIA/nccl v2.30.7, commit 5067397c; src/graph/topo.h and topo.cc), which its
graph search and tuning model then read (fxacct.parallel.nccl_model):

- NVLink: links per GPU (the GPU's datasheet: total bidirectional NVLink bandwidth ÷ the
  bidirectional bandwidth of one link) × NCCL's per-link figure for the architecture
  (topo.h:21-24, ``SM80_NVLINK_BW`` 20.0, ``SM90_NVLINK_BW`` 20.6, ``SM100_NVLINK_BW`` 40.1).
- PCIe: lanes × the per-lane rate of the generation in 100 Mb/s units ÷ 80 (topo.cc:545-555
  ``kvDictPciGen``: 16.0 GT/s → 120, 32.0 GT/s → 240; topo.cc:657 ``bw = width * speed / 80.0``).
- Network: the NIC's port speed in Mb/s ÷ 8000 (topo.cc:418 ``net->net.bw = mbps / 8000.0``).
  NCCL's tuning model has one row for every network (tuning.cc:170 ``NET``), so InfiniBand and
  RoCE of the same port speed cost the same; one NIC per GPU, as in NVIDIA's DGX nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxacct.errors import UsageError


@dataclass(frozen=True)
class Interconnect:
    name: str
    kind: str  # "nvlink", "pcie" (within a node) or "net" (between nodes)
    gb_per_s: float  # per GPU, one direction, as NCCL's topology counts it
    source: str


INTERCONNECTS: dict[str, Interconnect] = {i.name: i for i in (
    # A100 datasheet: NVLink 600 GB/s bidirectional = 12 links × 50 GB/s; 12 × SM80_NVLINK_BW 20.0
    Interconnect("nvlink3", "nvlink", 12 * 20.0, "NVLink 3: 12 links × 20.0 GB/s (A100 datasheet; nccl topo.h:21)"),
    # H100/H200 SXM datasheets: NVLink 900 GB/s bidirectional = 18 links × 50 GB/s; 18 × 20.6
    Interconnect("nvlink4", "nvlink", 18 * 20.6, "NVLink 4: 18 links × 20.6 GB/s (H100 datasheet; nccl topo.h:22)"),
    # B200 (DGX B200 datasheet): NVLink 5 1.8 TB/s bidirectional = 18 links × 100 GB/s; 18 × 40.1
    Interconnect("nvlink5", "nvlink", 18 * 40.1, "NVLink 5: 18 links × 40.1 GB/s (DGX B200 datasheet; nccl topo.h:24)"),
    # PCIe Gen4 x16: 16 lanes × 120 / 80 = 24 GB/s; Gen5 x16: 16 × 240 / 80 = 48 GB/s
    Interconnect("pcie4", "pcie", 16 * 120 / 80, "PCIe Gen4 x16: 24 GB/s (nccl topo.cc:553,657)"),
    Interconnect("pcie5", "pcie", 16 * 240 / 80, "PCIe Gen5 x16: 48 GB/s (nccl topo.cc:554,657)"),
    # ConnectX-6 HDR 200 Gb/s, ConnectX-7 NDR 400 Gb/s (DGX A100 / DGX H100 datasheets): Mb/s ÷ 8000
    Interconnect("ib-hdr", "net", 200_000 / 8000, "InfiniBand HDR 200 Gb/s per GPU: 25 GB/s (nccl topo.cc:418)"),
    Interconnect("ib-ndr", "net", 400_000 / 8000, "InfiniBand NDR 400 Gb/s per GPU: 50 GB/s (nccl topo.cc:418)"),
    # ConnectX-7 / Spectrum-X Ethernet ports at 400 and 200 GbE; NCCL's model costs them as any NET
    Interconnect("roce", "net", 400_000 / 8000, "RoCE 400 GbE per GPU: 50 GB/s (nccl topo.cc:418)"),
    Interconnect("roce-200", "net", 200_000 / 8000, "RoCE 200 GbE per GPU: 25 GB/s (nccl topo.cc:418)"),
)}
NETWORKS = tuple(name for name, i in INTERCONNECTS.items() if i.kind == "net")


@dataclass(frozen=True)
class NodeSystem:
    """A GPU's reference node: what links its GPUs inside the node, the fabric between nodes, and
    what NCCL's tuning reads of it (architecture, NVSwitch for NVLS, the host CPU's vendor)."""

    intra: str  # a key of INTERCONNECTS (nvlink* or pcie*)
    network: str  # the default --interconnect
    arch: int  # NCCL's compute-capability index (tuning.cc:263-266): 1 Ampere/Ada, 2 Hopper, 3 Blackwell
    nvswitch: bool  # GPUs on NVSwitches (NVLS possible on Hopper and later)
    cpu: str  # "intel" or "amd": NCCL's LL bandwidth and network overhead differ (tuning.cc:228-233, 269-271)
    source: str


_DGX_H100 = NodeSystem("nvlink4", "ib-ndr", 2, True, "intel",
                       "DGX H100/H200: NVSwitch, 8× ConnectX-7 NDR 400 Gb/s, Xeon Platinum 8480C (DGX H100 datasheet)")
SYSTEMS: dict[str, NodeSystem] = {
    "h100": _DGX_H100,
    "h200": _DGX_H100,
    # H100 PCIe: PCIe Gen5 x16 (datasheet; its NVLink bridge joins pairs only); no reference
    # cluster: NDR assumed, as for the SXM part
    "h100-pcie": NodeSystem("pcie5", "ib-ndr", 2, False, "intel",
                            "H100 PCIe: PCIe Gen5 x16 (datasheet); network assumed NDR 400 Gb/s per GPU"),
    "a100": NodeSystem("nvlink3", "ib-hdr", 1, True, "amd",
                       "DGX A100: NVSwitch, 8× ConnectX-6 HDR 200 Gb/s, 2× EPYC 7742 (DGX A100 datasheet)"),
    "b200": NodeSystem("nvlink5", "ib-ndr", 3, True, "intel",
                       "DGX B200: NVSwitch, 8× ConnectX-7 400 Gb/s, Xeon Platinum 8570 (DGX B200 datasheet)"),
    # L40S: PCIe Gen4 x16, no NVLink (L40S datasheet); no reference training cluster: 200 GbE assumed
    "l40s": NodeSystem("pcie4", "roce-200", 1, False, "intel",
                       "L40S: PCIe Gen4 x16, no NVLink (datasheet); network assumed RoCE 200 GbE per GPU"),
}


def node_system(gpu: str) -> NodeSystem:
    """The reference node of a --gpu key; a variant of a listed part (``a100-40gb``, a 96 GB
    ``h100-...``) takes its family's node: the longest key it starts with."""
    key = gpu.lower()
    family = max((k for k in SYSTEMS if key.startswith(k)), key=len, default=None)
    if family is None:
        raise UsageError(f"no interconnect model for --gpu {gpu!r}: fxacct knows the nodes of {', '.join(SYSTEMS)}")
    return SYSTEMS[family]


def network(name: str | None, gpu: str | None = None) -> Interconnect:
    """--interconnect NAME, or the reference node's fabric of ``gpu`` when NAME is None."""
    if name is None:
        return INTERCONNECTS[node_system(gpu).network]
    if name not in NETWORKS:
        raise UsageError(f"unknown --interconnect {name!r}: use one of {', '.join(NETWORKS)}")
    return INTERCONNECTS[name]

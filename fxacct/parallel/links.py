"""Link figures for collective time (α–β): per GPU, per direction, within a node (NVLink) and
between nodes (InfiniBand, one NIC per GPU as in DGX systems), by --gpu.

β, bytes/s one GPU sends in one direction:
- H100 / H200 SXM: NVLink 4, 900 GB/s bidirectional per GPU (NVIDIA H100 and H200 datasheets)
  → 450e9; between nodes ConnectX-7 InfiniBand NDR, 400 Gb/s per GPU (DGX H100 user guide) → 50e9.
- H100 PCIe: NVLink bridge 600 GB/s bidirectional (H100 PCIe datasheet) → 300e9; NDR 400 Gb/s.
- A100 SXM (80 and 40 GB): NVLink 3, 600 GB/s bidirectional (A100 datasheet) → 300e9; between
  nodes ConnectX-6 HDR, 200 Gb/s per GPU (DGX A100 user guide) → 25e9.
α, seconds per ring step: a guess of the order NCCL's own tuning model uses for its ring
protocols (src/graph/tuning.cc base latencies of a few µs, plus a hop): 2 µs within a node,
5 µs between nodes. Large transfers are bandwidth-bound and do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    source: str
    intra_alpha_s: float = 2e-6  # a guess (module docstring)
    inter_alpha_s: float = 5e-6  # a guess (module docstring)


_SXM4 = Links(450e9, 50e9, "NVLink 4 900 GB/s bidirectional per GPU; InfiniBand NDR 400 Gb/s per GPU")
LINKS = {
    "h100": _SXM4,
    "h200": _SXM4,
    "h100-pcie": Links(300e9, 50e9, "NVLink bridge 600 GB/s bidirectional; InfiniBand NDR 400 Gb/s per GPU"),
    "a100": Links(300e9, 25e9, "NVLink 3 600 GB/s bidirectional per GPU; InfiniBand HDR 200 Gb/s per GPU"),
    "a100-40gb": Links(300e9, 25e9, "NVLink 3 600 GB/s bidirectional per GPU; InfiniBand HDR 200 Gb/s per GPU"),
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md: "fully connected with NVLink" (NVLink 4 of
    # the H100 SXM5), "400 Gb/s per GPU" RDMA between hosts
    "h100-96gb": Links(450e9, 50e9, "NVLink 4 900 GB/s bidirectional per GPU; RDMA 400 Gb/s per GPU (torchtitan)"),
    # HGX B200 datasheet: NVLink 5, 1.8 TB/s bidirectional per GPU; DGX B200: ConnectX-7 400 Gb/s per GPU
    "b200": Links(900e9, 50e9, "NVLink 5 1.8 TB/s bidirectional per GPU; InfiniBand NDR 400 Gb/s per GPU"),
    # L40S datasheet: no NVLink, PCIe Gen4 x16 64 GB/s bidirectional; between nodes HDR 200 Gb/s per GPU
    # ASSUMED (no reference system publishes one)
    "l40s": Links(32e9, 25e9, "PCIe Gen4 x16 64 GB/s bidirectional; 200 Gb/s per GPU between nodes (assumed)"),
}


def within_node(spec, gpus_per_node: int) -> dict[str, bool]:
    """Mesh dims are laid out outer to inner, inner ones on neighbouring ranks: a dimension's group
    stays within a node when its size times the sizes of every dim inside it fits in one node."""
    placed, inner = {}, 1
    for name, size in reversed(spec.dims):
        inner *= size
        placed[name] = inner <= gpus_per_node
    placed["world"] = spec.world_size <= gpus_per_node
    return placed


RING_STEPS = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1, "all_reduce": lambda n: 2 * (n - 1),
              "all_to_all": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 0, "wait": lambda n: 0}


def collective_seconds(op: str, n: int, wire_bytes: int, links: Links, intra: bool) -> float:
    """α–β: ring steps × α + wire bytes ÷ β of the link the group runs over."""
    alpha, beta = ((links.intra_alpha_s, links.intra_bytes_per_s) if intra
                   else (links.inter_alpha_s, links.inter_bytes_per_s))
    return RING_STEPS.get(op, lambda n: n - 1)(n) * alpha + wire_bytes / beta

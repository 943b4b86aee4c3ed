"""Where each collective runs and how long NCCL takes for it: the mesh's dims placed on nodes
(inner dims on neighbouring ranks), the node of --gpu with the fabric of --interconnect between
nodes (fxacct.interconnects), and NCCL's own model per collective (fxacct.parallel.nccl_model).

All-to-all and send/recv are NCCL's point-to-point path, which its tuning model does not cover:
here one ring-Simple base latency plus one hop of the link (tuning.cc:149-176), and the bytes
this rank sends at the ring graph's bandwidth (channels × speed)."""

from __future__ import annotations

from dataclasses import dataclass

from fxacct.interconnects import INTERCONNECTS, Interconnect, network, node_system
from fxacct.parallel.nccl_model import BASE_LAT, HW_LAT, RING, SIMPLE, Choice, Fabric, Group, choose, ring_graph

TUNED = ("all_reduce", "all_gather", "reduce_scatter")  # what ncclTopoTuneModel models


@dataclass(frozen=True)
class Links:
    intra: Interconnect
    network: Interconnect
    fabric: Fabric
    system: str  # the reference node's description (fxacct.interconnects.SYSTEMS)

    @property
    def source(self) -> str:
        return f"{self.intra.source}; {self.network.source}; NCCL 2.30.7 tuning model"


def links_for(gpu: str, interconnect: str | None) -> Links:
    """The links of ``gpu``'s reference node, its network replaced by ``interconnect`` if given."""
    system = node_system(gpu)
    intra, net = INTERCONNECTS[system.intra], network(interconnect, gpu)
    fabric = Fabric("nvlink" if intra.kind == "nvlink" else "pcie", intra.gb_per_s, net.gb_per_s, system.arch,
                    system.nvswitch, system.cpu)
    return Links(intra, net, fabric, system.source)


def placement(spec, gpus_per_node: int) -> dict[str, Group]:
    """Mesh dim -> its communicator. Dims are laid out outer to inner, inner ones on neighbouring
    ranks: a dim of size s inside dims of product m has all s ranks in one node when m·s fits a
    node, one per node when m fills a node, else gpus_per_node // m per node."""
    groups, inner = {}, 1
    for name, size in reversed(spec.dims):
        if inner * size <= gpus_per_node:
            per_node = size
        elif inner >= gpus_per_node:
            per_node = 1
        else:
            per_node = max(1, gpus_per_node // inner)
        groups[name] = Group(size, min(per_node, size))
        inner *= size
    groups["world"] = Group(spec.world_size, min(spec.world_size, gpus_per_node))
    return groups


def within_node(spec, gpus_per_node: int) -> dict[str, bool]:
    """Mesh dim -> whether its communicator stays inside one node."""
    return {name: g.nodes == 1 for name, g in placement(spec, gpus_per_node).items()}


def collective_choice(op: str, group: Group, nbytes: int, wire_bytes: int, links: Links) -> Choice:
    """NCCL's pick and time for one collective. ``nbytes``: the whole tensor (an all-gather's
    output, a reduce-scatter's input, an all-reduce's buffer); ``wire_bytes``: what this rank sends
    (the point-to-point ops' cost)."""
    if op in TUNED:
        return choose(op, nbytes, group, links.fabric)
    if op in ("all_to_all", "send") and wire_bytes:
        hw = "net" if group.nodes > 1 else links.fabric.intra_kind
        g = ring_graph(group, links.fabric)
        lat_us = BASE_LAT[RING][2] + HW_LAT[hw][RING][2]
        return Choice("p2p", SIMPLE, (lat_us + wire_bytes / (1000 * g.channels * g.gbs)) * 1e-6)
    return Choice("none", "", 0.0)  # a recv (its send carries the time), a wait


def nccl_bytes(op: str, buffer_bytes: int, wire_bytes: int) -> int:
    """NCCL's nBytes (enqueue.cc:2127, count × nRanks for all-gather and reduce-scatter) from a
    collective node's figures: a reduce-scatter's buffer is its output shard, its input the shard
    plus what it sends."""
    return buffer_bytes + wire_bytes if op == "reduce_scatter" else buffer_bytes

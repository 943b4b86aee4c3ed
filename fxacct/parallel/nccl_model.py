"""One collective's time as NCCL predicts it, and the algorithm and protocol NCCL picks by it.

Written from NVIDIA/nccl v2.30.7 (commit 5067397c): ``ncclTopoTuneModel`` (src/graph/tuning.cc
:243-617) gives each (algorithm, protocol) a latency in µs and a bandwidth in GB/s;
``ncclTopoGetAlgoTime`` (tuning.cc:630-655) makes them a time, ``lat + nBytes / (1000 · bw)`` µs,
with nBytes the whole tensor (the gathered output of an all-gather, the full input of a
reduce-scatter; enqueue.cc:2127); ``topoGetAlgoInfo`` (enqueue.cc:2028) keeps the fastest.

The bandwidths start from the graphs NCCL's topology search finds (src/graph/search.cc); here
for the one link that bounds a GPU (fxacct.interconnects): the search tries the architecture's
per-channel speeds and keeps the graph with the most bandwidth (channels × speed), a ring at
most MAXCHANNELS / 2 = 32 channels (init.cc:1177), then doubles its channels at half the speed
(``ncclTopoDupChannels``, search.cc:1036-1048); the tree takes the ring's channels (init.cc:1185).
Simplifications, stated: a balanced tree (no ×0.85 of the plain tree pattern, tuning.cc:336); the
network's reported latency 0 (IB transport, net_ib/init.cc:558); CollNet (SHARP) off, as NCCL
has it unless configured (tuning.cc:504); no tuner plugin, NCCL_ALGO or NCCL_PROTO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RING, TREE, NVLS, NVLS_TREE, PAT = "ring", "tree", "nvls", "nvls_tree", "pat"
LL, LL128, SIMPLE = "LL", "LL128", "Simple"
PROTOCOLS = (LL, LL128, SIMPLE)
ALGORITHMS = (TREE, RING, NVLS, NVLS_TREE, PAT)  # NCCL's loop order (ties keep the first)
MAX_RING_CHANNELS = 32  # MAXCHANNELS 64 (device.h:91) / 2 (init.cc:1177)

# µs, per protocol (LL, LL128, Simple): baseLatencies (tuning.cc:149-155)
BASE_LAT = {TREE: (6.8, 14.0, 8.4), RING: (6.6, 14.0, 8.4), NVLS: (0, 0, 0), NVLS_TREE: (0, 0, 0),
            PAT: (8.0, 8.0, 8.0)}
# µs per hop by link: hwLatencies (tuning.cc:156-176)
HW_LAT = {
    "nvlink": {TREE: (0.6, 1.25, 4.0), RING: (0.6, 1.9, 3.4), NVLS: (0, 0, 25), NVLS_TREE: (0, 0, 25), PAT: (0, 0, 4.0)},
    "pcie": {TREE: (1.0, 1.9, 4.0), RING: (1.0, 2.5, 5.7), NVLS: (0, 0, 0), NVLS_TREE: (0, 0, 0), PAT: (0, 0, 4.0)},
    "net": {TREE: (5.0, 8.5, 14), RING: (2.7, 4.0, 14.0), NVLS: (0, 0, 18), NVLS_TREE: (0, 0, 20.9), PAT: (0, 0, 14)},
}
# GB/s, rows by architecture index (0 Volta, 1 Ampere, 2 Hopper, 3 Blackwell), columns by nodes (1, 2, >2)
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))  # tuning.cc:177-182
PER_CH_MAX_RING_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (40.0,) * 3)  # tuning.cc:184-189
PER_CH_MAX_TREE_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))  # tuning.cc:191-196
PER_CH_MAX_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))  # tuning.cc:198-203
PER_CH_MAX_NVLS_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))  # tuning.cc:205-210
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)  # tuning.cc:139-144
# tree all-reduce bandwidth correction by log2(nBytes / 64), 64 B to 256 MB (tuning.cc:623-627)
TREE_CORRECTION = {
    LL: (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    LL128: (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    SIMPLE: (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
# per-channel speeds the search tries, GB/s, by architecture index (search.cc:1051-1065)
_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
_INTER = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12)
SPEEDS_INTRA = (_INTRA, _INTRA, (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
                (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0))
SPEEDS_INTER = (_INTER, _INTER, (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4,
                                 1.2, 0.24, 0.12),
                (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4,
                 1.2, 0.24, 0.12))


@dataclass(frozen=True)
class Group:
    """A communicator: ``ranks`` GPUs, ``per_node`` of them in each node."""

    ranks: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.per_node)


@dataclass(frozen=True)
class Fabric:
    """What the model reads of the hardware (fxacct.interconnects): the link inside a node and its
    GB/s, the NIC's GB/s, the architecture index, NVSwitch, the CPU vendor."""

    intra_kind: str  # "nvlink" or "pcie"
    intra_gbs: float
    nic_gbs: float
    arch: int
    nvswitch: bool
    cpu: str


@dataclass(frozen=True)
class Graph:
    channels: int
    gbs: float  # per channel


@dataclass(frozen=True)
class Choice:
    algorithm: str
    protocol: str
    seconds: float


def _search(speeds, fits) -> tuple[int, float]:
    """The graph with the most bandwidth: from the fastest speed down, the channels that fit it;
    the largest channels × speed is kept (the faster on a tie), and slower speeds are tried only
    while above 0.49 × the kept one's (search.cc:1245)."""
    best = (0, 0.0)
    for s in speeds:
        if best[0] and s / best[1] <= .49:
            break
        n = fits(s)
        if n * s > best[0] * best[1]:
            best = (n, s)
    return best


def ring_graph(group: Group, fabric: Fabric) -> Graph:
    """Channels and speed of the ring graph: inside a node each channel's ring takes ``speed`` of
    every GPU's link; across nodes it also leaves through a NIC (one per GPU of the group)."""
    if group.nodes == 1:
        n, s = _search(SPEEDS_INTRA[fabric.arch],
                       lambda s: min(MAX_RING_CHANNELS, int(fabric.intra_gbs // s)))
    else:
        nics = group.per_node * fabric.nic_gbs
        n, s = _search([s for s in SPEEDS_INTER[fabric.arch] if s <= fabric.nic_gbs],
                       lambda s: min(MAX_RING_CHANNELS, int(nics // s),
                                     int(fabric.intra_gbs // s) if group.per_node > 1 else MAX_RING_CHANNELS))
    # ncclTopoDupChannels (search.cc:1036-1048)
    if s < 25.0 or (fabric.arch >= 2 and s < 50.0 and n > 4):
        return Graph(n, s)
    dup = min(2 * n, MAX_RING_CHANNELS)
    return Graph(dup, s / math.ceil(dup / n))


def nvls_graph(group: Group, fabric: Fabric) -> Graph | None:
    """NVLink SHARP needs NVSwitches and Hopper or later (search.cc:1124); one channel per GPU of
    the node (search.cc:1127, 1137), each at a speed that fits the GPU's link, which the
    search lets run ndevs / (ndevs − 1) over for non-ring patterns (search.cc:1168)."""
    if not fabric.nvswitch or fabric.arch < 2 or group.per_node < 2:
        return None
    n = min(32, group.per_node)  # NCCL_MAX_NVLS_ARITY (device.h:213)
    room = fabric.intra_gbs * group.per_node / (group.per_node - 1)
    speeds = SPEEDS_INTRA[fabric.arch] if group.nodes == 1 else \
        [s for s in SPEEDS_INTER[fabric.arch] if s <= fabric.nic_gbs and s * n <= group.per_node * fabric.nic_gbs]
    s = next((s for s in speeds if s * n <= room), None)
    return Graph(n, s) if s else None


def _nsteps(coll: str, n: int) -> int:
    return 2 * (n - 1) if coll == "all_reduce" else n - 1  # tuning.cc:289-291


def tune(coll: str, group: Group, fabric: Fabric) -> dict[tuple[str, str], tuple[float, float]]:
    """(algorithm, protocol) -> (latency µs, bandwidth GB/s) for ``coll`` (all_reduce, all_gather,
    reduce_scatter), the entries ncclTopoTuneModel leaves enabled (tuning.cc:284-434, 495-540)."""
    n, ppn, nodes, arch = group.ranks, group.per_node, group.nodes, fabric.arch
    i2 = min(nodes, 3) - 1  # tuning.cc:267
    i1 = arch if nodes == 1 else (1 if fabric.cpu == "amd" else 0)  # tuning.cc:269-271
    ring, nvls = ring_graph(group, fabric), nvls_graph(group, fabric)
    intra_hw, nsteps = fabric.intra_kind, _nsteps(coll, n)
    gathers = coll in ("all_gather", "reduce_scatter")
    algos = [RING]
    if coll == "all_reduce":
        algos.append(TREE)
    if nvls is not None and nodes == 1:  # NVLS across nodes needs CollNet (enqueue.cc:2008)
        algos.append(NVLS)
    if nvls is not None and nodes > 1 and coll == "all_reduce":
        algos.append(NVLS_TREE)  # disabled on one node (tuning.cc:501-502)
    if gathers and ppn == 1:  # PAT: one GPU per node (tuning.cc:216-222)
        algos.append(PAT)
    # LL128 on NVLink (or one GPU per node) only: typeIntra <= PATH_NVB (tuning.cc:521-533)
    protos = PROTOCOLS if (intra_hw == "nvlink" or ppn == 1) else (LL, SIMPLE)
    table = {}
    for a in ALGORITHMS:
        if a not in algos:
            continue
        g = nvls if a in (NVLS, NVLS_TREE) else ring
        for p in protos:
            if a in (NVLS, NVLS_TREE, PAT) and p != SIMPLE:
                continue
            k = PROTOCOLS.index(p)
            bw = g.gbs
            if a in (NVLS, NVLS_TREE):  # tuning.cc:307-323
                intra_bw = g.gbs * NVLS_EFFICIENCY[arch] * (g.channels - 1) / g.channels
                intra_bw *= 2.0 if coll == "all_reduce" else (ppn - 1) / ppn
                inter_bw = g.gbs * (2 if nodes <= 2 and a == NVLS_TREE else 1)
                bw = min(intra_bw, inter_bw, PER_CH_MAX_NVLS_TREE[arch][i2] if a == NVLS_TREE else math.inf)
            bus = g.channels * bw
            # model refinements (tuning.cc:326-337)
            if a == RING and p == LL:
                bus = min(LL_MAX_BW[i1][i2], bus * .5)
            if a == RING and p == LL128:
                bus = min(bus * 0.92, g.channels * PER_CH_MAX_RING_LL128[arch][i2])
            if a == TREE:
                bus = min(bus * .92, g.channels * PER_CH_MAX_TREE[arch][i2])
            if a == TREE and p == LL:
                bus = min(bus / 3.8, LL_MAX_BW[i1][i2])
            if a == TREE and p == LL128:
                bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                          g.channels * PER_CH_MAX_TREE_LL128[arch][i2])
            if a == PAT:
                bus *= .75
            # bus bandwidth to algorithm bandwidth (tuning.cc:376-382)
            if a == RING or not gathers:
                bus *= n / nsteps if a in (RING, NVLS, NVLS_TREE) else .5
            table[(a, p)] = (_latency(coll, a, k, group, fabric, intra_hw, nsteps), bus)
    return table


def _latency(coll, a, k, group: Group, fabric: Fabric, intra_hw: str, nsteps: int) -> float:
    """µs (tuning.cc:384-434); the network reports no latency (graph latencyInter = 0)."""
    n, ppn, nodes = group.ranks, group.per_node, group.nodes
    base = BASE_LAT[a][k]
    intra = HW_LAT[intra_hw][a][k]
    inter = HW_LAT["net"][TREE if ppn == 1 else a][k]
    if a == RING:
        overhead = 0.0
        if nodes > 1:  # getNetOverhead (tuning.cc:228-233): 1 µs Intel, 2 µs AMD; × 3 for Simple
            overhead = (2.0 if fabric.cpu == "amd" else 1.0) * (3 if k == 2 else 1)
        intra = max(intra, overhead)
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if coll == "all_reduce" else nodes - 1)
        return base + (nsteps - inter_steps) * intra + inter_steps * inter
    if a == TREE:
        return base + 2 * ((ppn - 1) * intra + _log2i(nodes) * inter)
    if a == NVLS:
        return intra
    if a == NVLS_TREE:
        return base + intra + 2 * _log2i(nodes) * inter
    return base + _log2i(nodes) * (inter / 3.5) + n * 2.8  # PAT


def _log2i(x: int) -> int:
    return max(0, int(x).bit_length() - 1)  # utils.h:56, floor(log2)


def algo_seconds(coll: str, a: str, p: str, lat_us: float, bw_gbs: float, nbytes: int, group: Group,
                 channels: int, arch: int) -> float:
    """ncclTopoGetAlgoTime (tuning.cc:630-655), one operation (no aggregation)."""
    log_size = _log2i(nbytes >> 6) if nbytes >> 6 else -1
    if a == TREE and coll == "all_reduce" and 0 <= log_size < 23:
        bw_gbs *= TREE_CORRECTION[p][log_size]
    if a == NVLS_TREE and coll == "all_reduce" and 0 <= log_size < 24 and arch >= 3:
        bw_gbs *= TREE_CORRECTION[p][log_size]  # Blackwell on x86 hosts (tuning.cc:643-646)
    if a == RING and p == SIMPLE and group.nodes > 1 and coll == "all_reduce" \
            and nbytes / (channels * group.ranks) >= 64:
        lat_us *= 1.4 if arch >= 1 else 1.9  # "plateau effect of ring" (tuning.cc:647-650), SM80 and later
    return (lat_us + nbytes / (1000 * bw_gbs)) * 1e-6


def choose(coll: str, nbytes: int, group: Group, fabric: Fabric) -> Choice:
    """The fastest enabled (algorithm, protocol) for ``nbytes`` (the whole tensor), as NCCL picks."""
    if group.ranks <= 1:
        return Choice(RING, SIMPLE, 0.0)  # updateCollCostTable: nRanks 1 costs nothing (enqueue.cc:1993)
    channels = ring_graph(group, fabric).channels
    best = None
    for (a, p), (lat, bw) in tune(coll, group, fabric).items():
        if bw <= 0:
            continue
        t = algo_seconds(coll, a, p, lat, bw, nbytes, group, channels, fabric.arch)
        if best is None or t < best.seconds:
            best = Choice(a, p, t)
    return best

"""Communication time (issue 22 item 3): each collective as NCCL's tuning model times it and picks
its algorithm, mesh dims placed within or across nodes, and the step as the critical path over
the streams FSDP2 and c10d run on (networkx)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from helpers import target

import fxacct
from fxacct.interconnects import INTERCONNECTS, network, node_system
from fxacct.load.mesh import parse_mesh
from fxacct.parallel.links import collective_choice, links_for, placement, within_node
from fxacct.parallel.nccl_model import Group, choose, ring_graph
from fxacct.parallel.streams import critical_path

H100 = links_for("h100", None)


def test_all_gather_closed_form_latency_and_bandwidth_bound():
    """All-gather over the 8 H100s of one DGX node (NCCL 2.30.7, src/graph/tuning.cc).
    The ring graph: NVLink 4 is 18 × 20.6 = 370.8 GB/s per GPU; the search's first Hopper speed,
    60 GB/s, fits 6 channels (360 GB/s; no slower speed gives more), doubled at half speed:
    12 channels × 30 GB/s (search.cc ncclTopoDupChannels). Ring, 7 steps, algbw = busBw × 8/7.
    - 64 KiB: ring LL, busBw min(llMaxBw Hopper 141, 360 × 0.5) = 141 GB/s; latency
      6.6 + 7 × 0.6 = 10.8 µs → 10.8 + 65536 / (1000 · 141 · 8/7) µs (LL128 starts at 27.3 µs,
      Simple at 32.2, NVLS at 25: latency decides).
    - 1 GiB: ring Simple, busBw 360; latency 8.4 + 7 × 3.4 = 32.2 µs → 32.2 + 2^30 / (1000 · 360
      · 8/7) µs = 2642 µs (LL128: 360 × 0.92 = 331.2 GB/s, 2837 µs; NVLS: 8 channels × 50 GB/s ×
      0.85 × 7/8 × 7/8 = 260.3 GB/s, 4150 µs: bandwidth decides)."""
    group = Group(8, 8)
    assert ring_graph(group, H100.fabric).channels == 12 and ring_graph(group, H100.fabric).gbs == 30.0
    small = choose("all_gather", 65536, group, H100.fabric)
    assert (small.algorithm, small.protocol) == ("ring", "LL")
    assert small.seconds == pytest.approx((10.8 + 65536 / (1000 * 141 * 8 / 7)) * 1e-6)
    big = choose("all_gather", 2**30, group, H100.fabric)
    assert (big.algorithm, big.protocol) == ("ring", "Simple")
    assert big.seconds == pytest.approx((32.2 + 2**30 / (1000 * 360 * 8 / 7)) * 1e-6)
    # a reduce-scatter's model is the all-gather's (tuning.cc: same steps, same refinements)
    assert collective_choice("reduce_scatter", group, 2**30, 7 * 2**30 // 8, H100).seconds == big.seconds


def test_ring_bus_bandwidth_against_nccls_published_h100_figure():
    """NCCL's maintainer (NVIDIA/nccl-tests issue 212, 2024-05-06): on 8 H100s "NCCL can get an
    effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running
    non-allreduce operations" (450 GB/s line rate less ~20% protocol overhead). The model's
    all-gather of 16 GiB: busBw = algbw × (n − 1)/n, within 5% of it (360 GB/s: 0.973)."""
    size = 16 * 2**30
    t = choose("all_gather", size, Group(8, 8), H100.fabric).seconds
    bus = size / t * 7 / 8
    assert bus == pytest.approx(370e9, rel=0.05)


def test_ring_and_tree_flip_for_an_all_reduce_across_nodes():
    """All-reduce over 8 H100 nodes, one GPU each (fsdp=8 outside tp=8): the ring graph is one
    NDR NIC, 50 GB/s: the search's 48 GB/s fits 1 channel, doubled: 2 × 24 = 48 GB/s.
    Tree LL128: busBw min(48 × 0.92, 2 × 36.0) = 44.16, × 120/128 = 41.4, algbw × 0.5 = 20.7 GB/s;
    latency 14.0 + 2 × log2(8) × 8.5 = 65 µs; NCCL's tree correction for log2(nBytes/64).
    Ring LL128: busBw 44.16 (under 2 × 36.7), algbw × 8/14 = 25.234 GB/s; latency 14.0 + 14
    network steps × 8.5 = 133 µs.
    - 1 MiB: tree 65 + 2^20 / (1000 · 20.7 · 0.6) = 149.4 µs < ring 133 + 2^20 / 25234 = 174.6 µs
    - 16 MiB: tree 65 + 2^24 / (1000 · 20.7 · 0.9) = 965.5 µs > ring 133 + 2^24 / 25234 = 797.9 µs
    (the other entries are slower at both sizes; e.g. ring Simple at 16 MiB: 204.4 × 1.4 +
    2^24 / 27429 = 897.8 µs)."""
    group = Group(8, 1)
    mib = choose("all_reduce", 2**20, group, H100.fabric)
    assert (mib.algorithm, mib.protocol) == ("tree", "LL128")
    assert mib.seconds == pytest.approx((65 + 2**20 / (1000 * 20.7 * 0.6)) * 1e-6)
    big = choose("all_reduce", 2**24, group, H100.fabric)
    assert (big.algorithm, big.protocol) == ("ring", "LL128")
    assert big.seconds == pytest.approx((133 + 2**24 / (1000 * 44.16 * 8 / 14)) * 1e-6)


def test_interconnects_and_defaults():
    """NCCL's NET bandwidth is the port speed in Mb/s ÷ 8000: NDR 400 Gb/s → 50 GB/s, HDR → 25;
    the DGX A100 node defaults to HDR, the DGX H100 to NDR; across 2 nodes of 8 A100s the ring is
    bounded by 8 HDR NICs: 8 × 25 = 200 GB/s (10 channels × 20 GB/s)."""
    assert network(None, "h100").name == "ib-ndr" and network("ib-hdr").gb_per_s == 25.0
    assert network(None, "a100").name == "ib-hdr" and network(None, "a100-40gb").name == "ib-hdr"
    assert INTERCONNECTS[node_system("h100-pcie").intra].gb_per_s == 48.0  # Gen5 x16: 16 × 240 / 80
    a100 = links_for("a100", None).fabric
    g = ring_graph(Group(16, 8), a100)
    assert g.channels * g.gbs == 200.0
    with pytest.raises(fxacct.UsageError, match="unknown --interconnect 'ib-qdr'"):
        network("ib-qdr")


def test_placement_inner_dims_within_a_node():
    """fsdp=8,tp=8 on 8-GPU nodes: tp (8 neighbouring ranks) fits a node, fsdp (stride 8) has one
    rank per node; dp=2,fsdp=4,tp=2: tp (2) and fsdp (4·2 = 8) within, dp (16) across, one per node;
    fsdp=4,tp=4: fsdp's 4 ranks, 2 per node (stride 4 in nodes of 8)."""
    assert within_node(parse_mesh("fsdp=8,tp=8"), 8) == {"tp": True, "fsdp": False, "world": False}
    assert within_node(parse_mesh("dp=2,fsdp=4,tp=2"), 8) == {"tp": True, "fsdp": True, "dp": False, "world": False}
    assert placement(parse_mesh("fsdp=8,tp=8"), 8)["fsdp"] == Group(8, 1)
    assert placement(parse_mesh("fsdp=4,tp=4"), 8)["fsdp"] == Group(4, 2)


def _ag_graph(ag_s: float):
    """Program order: a0 (1 s), the all-gather of the next block's weights into ``buf`` (c10d, on
    FSDP2's all-gather stream), b (4 s, independent of it), d (1 s) reading ``buf``."""
    g = fx.Graph()
    x, shard = g.placeholder("x"), g.placeholder("shard")
    buf = g.create_node("call_function", torch.ops.aten.empty.memory_format, ([8],), name="buf")
    a0 = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="a0")
    g.create_node("call_function", torch.ops.c10d._allgather_base_.default, (buf, shard, "pg"), name="ag")
    b = g.create_node("call_function", torch.ops.aten.relu.default, (a0,), name="b")
    d = g.create_node("call_function", torch.ops.aten.add.Tensor, (b, buf), name="d")
    g.output(d)
    return critical_path(g, {"a0": 1.0, "ag": ag_s, "b": 4.0, "d": 1.0})


def test_an_all_gather_hides_under_compute():
    """The all-gather (3 s) starts with the step on its own stream and ends at 3 s, before d can
    start (a0 + b = 5 s): the step is the compute stream's 6 s, nothing exposed."""
    s = _ag_graph(3.0)
    assert s.step_s == pytest.approx(6.0) and s.compute_s == pytest.approx(6.0)
    assert s.busy_s == {"compute": pytest.approx(6.0), "all_gather": pytest.approx(3.0)}
    assert s.start_s["ag"] == 0.0 and s.start_s["d"] == pytest.approx(5.0)


def test_an_all_gather_longer_than_the_compute_under_it_is_exposed():
    """An 8 s all-gather: d waits for it until 8 s; exposed = 8 − (a0 + b) = 3 s, step 9 s."""
    s = _ag_graph(8.0)
    assert s.step_s == pytest.approx(9.0)
    assert s.step_s - s.compute_s == pytest.approx(8.0 - 5.0)


def test_fsdp2_forward_prefetch_by_hand():
    """Three FSDP2 units in forward, durations in s: each all-gather 2 (its output buffer and
    copy-in made on the all-gather stream), each copy-out 0.5 and block 1 (compute stream).
    ag0 0-2; co0 2-2.5; ag1 follows on its stream, 2-4 (nothing to wait for yet); ag2 waits for the
    copy-out before the last one, co0, and for ag1: 4-6; co1 4-4.5, f1 4.5-5.5; co2 6-6.5; f2
    6.5-7.5. Step 7.5 s against 4.5 s of compute. (Waiting for the last copy-out, as in backward,
    would start ag1 at 2.5 and ag2 at 5; a buffer made on the compute stream would hold each
    all-gather until the block before it ends.)"""
    import types

    import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

    g = fx.Graph()
    shard = g.placeholder("shard")
    aten, c10d, fsdp = torch.ops.aten, torch.ops.c10d, torch.ops.fsdp
    durations, prev = {}, None
    for i in range(3):
        def op(target, args, name, seconds=0.0):
            n = g.create_node("call_function", target, args, name=name)
            n.meta["fxacct"] = types.SimpleNamespace(phase="forward", kind="compute")
            durations[name] = seconds
            return n

        buf = op(aten.empty.memory_format, ([8],), f"buf{i}")
        ci = op(fsdp.all_gather_copy_in.default, ([shard], buf, [4], 4, 0), f"ci{i}")
        ag = op(c10d._allgather_base_.default, (buf, ci, "pg"), f"ag{i}", 2.0)
        out = g.create_node("call_function", operator.getitem, (ag, 0), name=f"out{i}")
        co = op(fsdp.split_with_sizes_copy.default, (out, [4, 4], 0, [buf]), f"co{i}", 0.5)
        prev = op(aten.relu.default, (co,), f"f{i}", 1.0) if prev is None else op(aten.add.Tensor, (co, prev), f"f{i}", 1.0)
    g.output(prev)
    s = critical_path(g, durations)
    assert s.stream["buf1"] == "all_gather" and s.stream["co1"] == "compute"
    assert [s.start_s[f"ag{i}"] for i in range(3)] == pytest.approx([0.0, 2.0, 4.0])
    assert [s.start_s[f"co{i}"] for i in range(3)] == pytest.approx([2.0, 4.0, 6.0])
    assert s.step_s == pytest.approx(7.5) and s.compute_s == pytest.approx(4.5)


def test_fsdp2_backward_waits_by_hand():
    """Two blocks' backward under FSDP2, durations in s: g1 (block 1's gradients, 2), its
    reduce-scatter copy-in cc1 (0.5, compute stream), rs1 (4, reduce-scatter stream, after the
    compute stream reached it), post1 (0: reads only rs1's output, so on its stream), g0 (block 0,
    3), cc0 (0.5), rs0 (2), the optimizer's first op (1).
    g1 0-2, cc1 2-2.5, rs1 2.5-6.5 while g0 runs 2.5-5.5; cc0 waits for rs1 (one reduce-scatter
    input in flight): 6.5-7; rs0 7-9; the optimizer waits for it: 9-10. Step 10 s; the compute
    stream's own ops 2 + 0.5 + 3 + 0.5 + 1 = 7 s, so 3 s exposed. (post1 on the compute stream
    would hold g0 until 6.5: 13 s; cc0 not waiting for rs1: 9.5 s.)"""
    import types

    import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

    g = fx.Graph()
    x = g.placeholder("x")

    def op(target, args, name, phase="backward"):
        n = g.create_node("call_function", target, args, name=name)
        n.meta["fxacct"] = types.SimpleNamespace(phase=phase, kind="compute")
        return n

    aten, c10d, fsdp = torch.ops.aten, torch.ops.c10d, torch.ops.fsdp
    g1 = op(aten.relu.default, (x,), "g1")
    out1, out0 = op(aten.empty.memory_format, ([4],), "out1"), op(aten.empty.memory_format, ([4],), "out0")
    cc1 = op(fsdp.chunk_cat.default, ([g1], 0, 2), "cc1")
    rs1 = op(c10d._reduce_scatter_base_.default, (out1, cc1, "pg"), "rs1")
    item = g.create_node("call_function", operator.getitem, (rs1, 0), name="rs1_out")
    op(aten._to_copy.default, (item,), "post1")
    g0 = op(aten.relu.default, (g1,), "g0")
    cc0 = op(fsdp.chunk_cat.default, ([g0], 0, 2), "cc0")
    op(c10d._reduce_scatter_base_.default, (out0, cc0, "pg"), "rs0")
    op(aten.mul.Tensor, (x, x), "opt", phase="optimizer")
    s = critical_path(g, {"g1": 2.0, "cc1": 0.5, "rs1": 4.0, "post1": 0.0, "g0": 3.0, "cc0": 0.5, "rs0": 2.0,
                          "opt": 1.0})
    assert s.stream["post1"] == "reduce_scatter" and s.stream["cc0"] == "compute"
    assert (s.start_s["rs1"], s.start_s["g0"], s.start_s["cc0"], s.start_s["rs0"], s.start_s["opt"]) == \
        pytest.approx((2.5, 2.5, 6.5, 7.0, 9.0))
    assert s.step_s == pytest.approx(10.0) and s.compute_s == pytest.approx(7.0)
    assert s.busy_s["reduce_scatter"] == pytest.approx(6.0)


@pytest.fixture(scope="module")
def fsdp_tp():
    cfg = fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, mesh="fsdp=2,tp=2",
                        parallelize=target("examples/llama.py:parallelize"), gpu="h100", find_max_batch=False)
    return fxacct.profile(cfg)


def _schedule(p):
    from fxacct.parallel.timing import step_schedule

    peak = p.memory.rank_peak.bytes if p.memory.rank_peak else None
    return step_schedule(p.capture, peak, p.config.mesh, p.config, p.parallel.collectives)


def test_fsdp2_reduce_scatters_overlap_the_backward_and_tp_collectives_are_exposed(fsdp_tp):
    """llama (2 blocks) at fsdp=2,tp=2 on H100s: each FSDP2 reduce-scatter but the last runs while
    backward ops run on the compute stream; the optimizer starts after the last one ends; every
    tensor-parallel collective is on the compute stream, so no compute op runs during it."""
    sched, comm, _, _, _ = _schedule(fsdp_tp)
    graph = fsdp_tp.capture.graph
    phase = {n.name: n.meta["fxacct"].phase for n in graph.nodes if "fxacct" in n.meta}
    rs = [c.node for c in fsdp_tp.parallel.collectives if c.op == "reduce_scatter"]
    assert len(rs) == 3 and all(sched.stream[r] == "reduce_scatter" for r in rs)
    compute = [n for n, s in sched.stream.items() if s == "compute" and comm.get(n) is None]

    def ops_during(node, phase_name):
        lo, hi = sched.start_s[node], sched.start_s[node] + comm[node]
        return [n for n in compute if phase.get(n) == phase_name and lo < sched.start_s[n] < hi]

    for r in rs[:-1]:
        assert ops_during(r, "backward"), f"{r} overlaps no backward op"
    first_optimizer = min(sched.start_s[n] for n in compute if phase.get(n) == "optimizer")
    assert first_optimizer >= sched.start_s[rs[-1]] + comm[rs[-1]] - 1e-15
    tp = [c for c in fsdp_tp.parallel.collectives if c.mesh_dim == "tp" and c.op != "wait"]
    assert tp and all(sched.stream[c.node] == "compute" for c in tp)
    for c in tp:
        lo, hi = sched.start_s[c.node], sched.start_s[c.node] + comm[c.node]
        assert not [n for n in compute if lo < sched.start_s[n] < hi]
    t = fsdp_tp.parallel.time
    assert t.exposed_comm_s >= sum(comm[c.node] for c in tp) - 1e-15
    # the stream holds the reduce-scatters and their output buffers (allocated under it)
    assert t.streams["reduce_scatter"] >= sum(comm[r] for r in rs)


def test_step_time_bounds_and_json(fsdp_tp):
    p = fsdp_tp
    t = p.parallel.time
    assert t.compute_s <= t.step_s <= sum(t.streams.values()) + 1e-12
    assert sum(r.predicted_ms for r in p.parallel.rows) == pytest.approx(1e3 * t.comm_s)
    from fxacct.predict.fused_time import predict_profile
    from fxacct.report import document
    from fxacct.report.summary_text import render_summary

    # with the roofline's prediction too (as the CLI passes it), the step is still the critical
    # path; the summary says the same figure
    prediction = predict_profile(p)
    d = document(p, prediction)
    assert d["totals"]["predicted_step_ms"] == pytest.approx(1e3 * t.step_s)
    from fxacct.report.durations import format_ms

    summary = render_summary(p, prediction)
    assert f"{format_ms(1e3 * t.step_s)} predicted on" in summary
    assert f"{format_ms(1e3 * t.exposed_comm_s)} of communication exposed" in summary
    # a tp group of 2 shares one batch: each GPU's share is half the group's; 4 GPUs make the job
    time_doc = d["mesh"]["time"]
    tokens = 2 * 64  # batch 2 × T = 64 (examples/llama.py's max_seq)
    assert time_doc["tokens_per_s_tp_group"] == pytest.approx(tokens / t.step_s)
    assert time_doc["tokens_per_s_gpu"] == pytest.approx(tokens / t.step_s / 2)
    assert time_doc["tokens_per_s_job"] == pytest.approx(4 * time_doc["tokens_per_s_gpu"])
    assert all(c["predicted_ms"] > 0 for c in d["collectives"])
    assert time_doc["interconnect"] == "ib-ndr"
    assert time_doc["streams_ms"]["compute"] >= time_doc["compute_ms"]
    assert sum(time_doc["nccl_algorithms"].values()) == sum(r["count"] for r in d["collectives"])


@pytest.mark.slow  # two traces; test_fsdp2_forward_prefetch_by_hand keeps the rule in the fast tier
def test_explicit_forward_prefetch_runs_all_gathers_earlier():
    """examples/llama.py with 4 blocks at fsdp=2 on H100s. Forward all-gathers and copy-outs come
    in unit order: root, layers.0 .. layers.3. Implicit prefetching: layers.3's all-gather waits
    for the copy-out of layers.1 (FSDP2 keeps one gathered result alive, so the all-gather streams
    wait on the copy-out before the last). With ``set_modules_to_forward_prefetch`` two blocks
    ahead (tests/models/llama_prefetch.py), layers.3's all-gather is issued in layers.1's
    pre-forward, after the wait on layers.0's copy-out: it runs before layers.1 is copied out."""
    starts = {}
    for name, par in (("implicit", "examples/llama.py:parallelize"),
                      ("explicit", "tests/models/llama_prefetch.py:parallelize")):
        p = fxacct.profile(fxacct.Config(target=target("examples/llama.py:Llama"), kwargs={"n_layers": 4}, batch=2,
                                         mesh="fsdp=2", gpu="h100", parallelize=target(par), find_max_batch=False))
        sched, comm, _, _, _ = _schedule(p)
        gathers = [c.node for c in p.parallel.collectives if c.op == "all_gather" and c.phase == "forward"]
        copy_outs = [n.name for n in p.capture.graph.nodes if str(n.target) == "fsdp.split_with_sizes_copy.default"]
        assert len(gathers) == 5 and len(copy_outs) >= 5
        starts[name] = (sched.start_s[gathers[4]], sched.start_s[copy_outs[2]])
    implicit_ag3, implicit_co1 = starts["implicit"]
    explicit_ag3, explicit_co1 = starts["explicit"]
    assert implicit_ag3 > implicit_co1  # waited for layers.1's copy-out
    assert explicit_ag3 < explicit_co1  # ran ahead of it

"""Communication time (item 4 of the --mesh work): α–β per collective with sourced links, mesh
dims placed within or across nodes, and the step as the critical path over the compute and
communication streams (networkx)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from helpers import target

import fxacct
from fxacct.load.mesh import parse_mesh
from fxacct.parallel.links import LINKS, collective_seconds, within_node
from fxacct.parallel.timing import critical_path


def test_alpha_beta_closed_form():
    """All-reduce of S = 1e9 B over n = 8 H100s in one node: the ring takes 2(n−1) = 14 steps of
    α = 2 µs and sends 2(n−1)/n·S = 1.75e9 B at 450e9 B/s: 28e-6 + 1.75e9/450e9 s."""
    h100 = LINKS["h100"]
    wire = 2 * 7 * 10**9 // 8
    assert collective_seconds("all_reduce", 8, wire, h100, True) == pytest.approx(28e-6 + 1.75e9 / 450e9)
    # the same all-gather across nodes: 7 steps of 5 µs, (n−1)/n·S at 50e9 B/s (NDR 400 Gb/s)
    assert collective_seconds("all_gather", 8, 7 * 10**9 // 8, h100, False) == pytest.approx(35e-6 + 0.875e9 / 50e9)


def test_placement_inner_dims_within_a_node():
    """fsdp=8,tp=8 on 8-GPU nodes: tp (8 neighbouring ranks) fits a node, fsdp (8 × 8) does not;
    dp=2,fsdp=4,tp=2: tp (2) and fsdp (4·2 = 8) within, dp (16) across."""
    assert within_node(parse_mesh("fsdp=8,tp=8"), 8) == {"tp": True, "fsdp": False, "world": False}
    assert within_node(parse_mesh("dp=2,fsdp=4,tp=2"), 8) == {"tp": True, "fsdp": True, "dp": False, "world": False}


def test_critical_path_of_a_hand_graph():
    """Program order a, c, b, d: c (a collective, 3 s) needs a (1 s); b (2 s) is independent of
    both; d (1 s) needs c. The compute stream alone is a, b, d = 4 s; the critical path is
    a → c → d = 1 + 3 + 1 = 5 s, with b overlapping c."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="a")
    c = g.create_node("call_function", torch.ops._c10d_functional.all_reduce.default, (a, "sum", "0"), name="c")
    g.create_node("call_function", torch.ops.aten.relu.default, (x,), name="b")
    d = g.create_node("call_function", torch.ops.aten.relu.default, (c,), name="d")
    g.output(d)
    assert critical_path(g, {"a": 1.0, "b": 2.0, "d": 1.0}, {"c": 3.0}) == pytest.approx(5.0)
    # a slow b (5 s) hides the collective: a, b, d = 7 s on the compute stream
    assert critical_path(g, {"a": 1.0, "b": 5.0, "d": 1.0}, {"c": 3.0}) == pytest.approx(7.0)


def test_step_time_bounds_and_json():
    cfg = fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, mesh="fsdp=2,tp=2",
                        parallelize=target("examples/llama.py:parallelize"), gpu="h100", find_max_batch=False)
    p = fxacct.profile(cfg)
    t = p.parallel.time
    assert t.compute_s <= t.step_s <= t.compute_s + t.comm_s + 1e-12
    assert sum(r.predicted_ms for r in p.parallel.rows) == pytest.approx(1e3 * t.comm_s)
    from fxacct.predict.roofline import predict_profile
    from fxacct.report import document
    from fxacct.report.summary_text import render_summary

    # with the roofline's prediction too (as the CLI passes it), the step is still the critical
    # path: the single stream times the collectives as local copies (it once replaced it, longer
    # than the compute stream it bounds); the summary says the same figure
    prediction = predict_profile(p)
    assert prediction.step_ms > 1e3 * t.compute_s
    d = document(p, prediction)
    assert d["totals"]["predicted_step_ms"] == pytest.approx(1e3 * t.step_s)
    from fxacct.report.durations import format_ms

    assert f"{format_ms(1e3 * t.step_s)} predicted on" in render_summary(p, prediction)
    # a tp group of 2 shares one batch: each GPU's share is half the group's; 4 GPUs make the job
    time_doc = d["mesh"]["time"]
    tokens = 2 * 64  # batch 2 × T = 64 (examples/llama.py's max_seq)
    assert time_doc["tokens_per_s_tp_group"] == pytest.approx(tokens / t.step_s)
    assert time_doc["tokens_per_s_gpu"] == pytest.approx(tokens / t.step_s / 2)
    assert time_doc["tokens_per_s_job"] == pytest.approx(4 * time_doc["tokens_per_s_gpu"])
    assert all(c["predicted_ms"] > 0 for c in d["collectives"])

"""torchtitan jobs run for real (``--mesh ... --runtime --device cpu``): torchtitan's model built,
parallelized and initialized by torchtitan's own code in gloo processes on real CPU tensors
(fxacct.runtime.titan_run), each rank measured by fxacct's storage tracker (its op-level peak) and
a collective counter (count and output-buffer bytes per op), beside the account of the fake-tensor
trace. Context parallelism and expert parallelism are torchtitan's only (fxacct's engine builds
neither), so these are their real-run checks; the router of a real run decides for itself, so
expert parallelism is checked with the histogram that run measured (``--expert-load``)."""

from __future__ import annotations

import json

import pytest
from helpers import invoke_profile

pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install 'fxacct[torchtitan]'")
pytestmark = pytest.mark.slow  # each test spawns a gloo process group and runs real steps (20-70 s)

RUN = ("--runtime", "--device", "cpu", "--steps", "1", "--warmup", "1", "--format", "json")


def _profile(*args) -> dict:
    r = invoke_profile(*args)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _within(measured: int, predicted: int, tolerance: float = 0.02) -> bool:
    return abs(measured - predicted) <= tolerance * predicted


def test_real_context_parallel_run_matches_the_account():
    """cp=2 (FSDP2 over the cp ranks, as torchtitan shards them), sequence 256: on each rank the
    FSDP2 gathers and reduce-scatters and context parallelism's k/v gathers (torch's
    cplib.flex_cp_allgather, one per layer and forward) and their gradients' reduce-scatters
    equal the account, count and bytes, and the op-level peak is within 2%."""
    doc = _profile("torchtitan:llama3:llama3_debugmodel", "--mesh", "cp=2", "--batch", "2", "--seq-len", "256", *RUN)
    ranks = doc["runtime_ranks"]
    assert len(ranks) == 2
    for r in ranks:
        for op, c in r["collectives"].items():
            assert (c["count"], c["bytes"]) == (c["predicted_count"], c["predicted_bytes"]), (r["rank"], op, c)
        assert r["collectives"]["all_gather"]["count"] > 17  # the FSDP2 gathers and the k/v gathers
        assert _within(r["op_level_peak_bytes"], r["predicted_peak_bytes"]), r


def test_real_expert_parallel_run_matches_the_account_of_its_measured_routing(tmp_path):
    """qwen3_moe_debug at fsdp=2,ep=2 (ep carved out of the fsdp ranks), the same tokens on both
    ranks, so both route alike (the histogram each records is the same). Balanced routing gives
    every count and the FSDP2 bytes; the all-to-all bytes follow the real router: the two ranks
    together move what the balanced account gives twice. The account of the histogram the run
    recorded (--expert-load) is of the busiest rank, whose all-to-all bytes it equals exactly."""
    target = ("torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=2,ep=2", "--batch", "2", "--seq-len", "64")
    doc = _profile(*target, *RUN)
    ranks = doc["runtime_ranks"]
    assert len(ranks) == 2
    for r in ranks:
        for op, c in r["collectives"].items():
            assert c["count"] == c["predicted_count"], (r["rank"], op, c)
            if op != "all_to_all":
                assert c["bytes"] == c["predicted_bytes"], (r["rank"], op, c)
        assert _within(r["op_level_peak_bytes"], r["predicted_peak_bytes"]), r
    moved = [r["collectives"]["all_to_all"]["bytes"] for r in ranks]
    assert sum(moved) == 2 * ranks[0]["collectives"]["all_to_all"]["predicted_bytes"]
    load = ranks[0]["expert_load"]
    assert load == ranks[1]["expert_load"] and len(load["layers"]) == 8 and len(load["layers"][0]) == 64

    path = tmp_path / "measured.json"
    path.write_text(json.dumps(load))
    measured = _profile(*target, "--expert-load", str(path), "--format", "json")
    busiest = max(ranks, key=lambda r: r["collectives"]["all_to_all"]["bytes"])
    ours = sum(c["bytes"] for c in measured["collectives"] if c["op"] == "all_to_all")
    assert ours == busiest["collectives"]["all_to_all"]["bytes"]
    assert any(f"busiest expert-parallel rank ({busiest['rank']}," in w for w in measured["warnings"])
    assert _within(busiest["op_level_peak_bytes"], measured["totals"]["peak_train_bytes"])

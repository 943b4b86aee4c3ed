"""--interconnect (issue 22 item 3): the network between nodes, on one device accepted with a note
that it changes nothing, under --mesh the fabric of the groups that cross nodes, and an unknown
name a one-line usage error (exit 2)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fxacct_cli.main import cli

MLP = ("examples/mlp.py:MLP", "-k", "d_model=64", "-k", "d_hidden=128", "-k", "n_blocks=2", "--batch", "2",
       "--format", "json")


def _run(*args, gpu=("--gpu", "h100")):
    return CliRunner().invoke(cli, ["profile", *MLP, *gpu, *args], catch_exceptions=False)


@pytest.mark.slow
def test_one_device_accepts_it_and_says_it_has_no_effect():
    plain, given = _run(gpu=()), _run("--interconnect", "ib-hdr", gpu=())
    assert plain.exit_code == 0 and given.exit_code == 0, given.output
    a, b = json.loads(plain.stdout), json.loads(given.stdout)
    assert a["totals"] == b["totals"]
    assert any("--interconnect ib-hdr has no effect on one device" in w for w in b["warnings"])


def test_unknown_interconnect_is_a_one_line_usage_error():
    r = CliRunner().invoke(cli, ["profile", *MLP, "--interconnect", "ib-qdr", "--mesh", "fsdp=2"])
    assert r.exit_code == 2, r.output
    line = [s for s in r.output.splitlines() if s.strip()]
    assert len(line) == 1 and "unknown --interconnect 'ib-qdr'" in line[0] and "ib-ndr" in line[0], r.output


def test_mesh_crossing_nodes_runs_on_the_chosen_network():
    """fsdp=2 with one GPU per node: the FSDP2 group crosses nodes, one rank each; its ring is one
    NIC. The MLP's collectives are a few KiB, latency-bound: ring LL (latency 6.6 + 1 network step
    × 5.0 = 11.6 µs, under PAT's 8.0 + log2(2) × 14 / 3.5 + 2 × 2.8 = 17.6 µs), whose latency does
    not depend on the NIC and whose bandwidth does: half the ring graph's, HDR's 1 channel × 24 GB/s
    against NDR's 2 × 24 GB/s."""
    ndr = json.loads(_run("--mesh", "fsdp=2", "--gpus-per-node", "1").stdout)
    hdr = json.loads(_run("--mesh", "fsdp=2", "--gpus-per-node", "1", "--interconnect", "ib-hdr").stdout)
    within = json.loads(_run("--mesh", "fsdp=2", "--interconnect", "ib-hdr").stdout)
    assert ndr["mesh"]["time"]["interconnect"] == "ib-ndr" and hdr["mesh"]["time"]["interconnect"] == "ib-hdr"
    assert hdr["mesh"]["time"]["comm_ms"] > ndr["mesh"]["time"]["comm_ms"]
    assert set(ndr["mesh"]["time"]["nccl_algorithms"]) == {"ring/LL"}
    # a mesh of one rank: accepted, nothing to send
    one = _run("--mesh", "fsdp=1", "--interconnect", "ib-hdr")
    assert one.exit_code == 0, one.output
    assert json.loads(one.stdout)["mesh"]["time"]["comm_ms"] == 0
    # within one node (8 GPUs per node, the default) the network carries nothing
    default_within = json.loads(_run("--mesh", "fsdp=2").stdout)
    assert within["mesh"]["time"]["comm_ms"] == default_within["mesh"]["time"]["comm_ms"]

"""`fxacct plan`: layouts that divide the GPUs and the batch, ranked by predicted throughput among
those that fit, each rejected one with its reason."""

from __future__ import annotations

from dataclasses import replace

from click.testing import CliRunner

import fxacct
from fxacct.parallel.planner import layouts, plan
from fxacct.predict import devices
from fxacct_cli.main import cli
from helpers import ROOT, target


def test_layouts_divide_gpus_and_batch():
    """8 GPUs on 8-GPU nodes: tp ∈ {1, 2, 4, 8}, fsdp = 8 / tp; global batch 16 over fsdp ranks:
    16/8 = 2, 16/4 = 4, 16/2 = 8, 16/1 = 16. A batch of 12 does not divide over 8 ranks (0)."""
    assert layouts(8, 16, 8) == [("fsdp=8", 2), ("fsdp=4,tp=2", 4), ("fsdp=2,tp=4", 8), ("tp=8", 16)]
    assert layouts(8, 12, 8)[0] == ("fsdp=8", 0)
    assert [m for m, _ in layouts(16, 16, 4)] == ["fsdp=16", "fsdp=8,tp=2", "fsdp=4,tp=4"]  # tp within a node


def test_plan_ranks_fitting_layouts_and_says_why_others_fail(monkeypatch):
    # a GPU of 3 MiB: fsdp=8 (micro-batch 2, peak 2.18 MiB) fits; fsdp=4,tp=2 (micro-batch 4) does not
    monkeypatch.setitem(devices.DEVICES, "h100", replace(devices.DEVICES["h100"], capacity_reported=3 * 2**20))
    cfg = fxacct.Config(target=target("examples/llama.py:Llama"), gpu="h100", mesh="fsdp=8",
                        parallelize=target("examples/llama.py:parallelize"), find_max_batch=False)
    cands = plan(cfg, 8, 16)
    fit = [c for c in cands if c.fits]
    assert [c.mesh for c in fit] == ["fsdp=8"] and fit[0].peak_bytes <= 3 * 2**20
    why = {c.mesh: c.rejected for c in cands if not c.fits}
    assert why["fsdp=4,tp=2"].startswith("over memory by ")
    assert "does not divide the model's n_kv_heads=2" in why["fsdp=2,tp=4"]
    assert "does not divide the model's n_heads=4" in why["tp=8"]
    assert cands[0] is fit[0]


def test_plan_cli_table():
    r = CliRunner().invoke(cli, ["plan", str(ROOT / "examples/llama.py") + ":Llama", "--gpus", "4", "--gpu", "h100",
                                 "--global-batch", "8", "--parallelize", str(ROOT / "examples/llama.py") + ":parallelize"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "fxacct plan: 4 × h100, global batch 8"
    ranked = [line.split()[1] for line in lines[3:] if line.split()[0].isdigit()]
    assert sorted(ranked) == ["fsdp=2,tp=2", "fsdp=4"]

"""--mesh pp=P: per-stage accounts, in-flight micro-batches under GPipe and 1F1B, send/recv
volume and the bubble, in closed form."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import fxacct
from fxacct_cli.main import cli
from helpers import ROOT, target
from parallel_oracle import load

LLAMA = "examples/llama.py:Llama"
SPLIT = "examples/llama.py:pipeline_stage"
KW = {"n_layers": 4}  # dim 64, vocab 512, T = 64


def _pipe(mesh, schedule, m=4, **kw):
    cfg = fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(KW), mesh=mesh, pp_split=target(SPLIT),
                        microbatches=m, pp_schedule=schedule, **kw)
    return fxacct.profile(cfg).parallel.pipeline


@pytest.mark.parametrize("schedule,expected", [("1f1b", [2, 1]), ("gpipe", [4, 4])])
def test_in_flight_microbatches(schedule, expected):
    """1F1B: stage s holds min(P − s, M) micro-batches (the first stage P = 2); GPipe holds all
    M = 4 on every stage. A stage's peak adds the saved activations of the extra ones."""
    pipe = _pipe("pp=2", schedule)
    assert [s.in_flight for s in pipe.stages] == expected
    for s in pipe.stages:
        one = s.profile.memory.peak_train.bytes
        assert s.peak_bytes == one + (s.in_flight - 1) * s.profile.accounting.totals.activation_bytes
    assert pipe.bubble_fraction == pytest.approx(1 / 5)  # (P − 1) / (M + P − 1) = 1 / 5


def test_stages_partition_the_model():
    """The stages hold every parameter once: tok_embeddings 512·64 + 2 blocks · 36992 on stage 0,
    2 blocks · 36992 + norm 64 + output 512·64 on stage 1 (1 + 4·36992 + ... = the whole model).
    Each boundary moves the (B, T, dim) = 2·64·64 fp32 activation, 32768 B, per micro-batch each
    way: 4 · 32768 = 131072 B sent per step by each of the two stages."""
    pipe = _pipe("pp=2", "1f1b")
    with torch.device("meta"):
        full = load(LLAMA)(**KW)
    assert sum(s.profile.accounting.totals.params for s in pipe.stages) == sum(p.numel() for p in full.parameters())
    assert [s.profile.accounting.totals.params for s in pipe.stages] == [32768 + 2 * 36992, 2 * 36992 + 64 + 32768]
    assert [s.send_bytes for s in pipe.stages] == [131072, 131072]


def test_pipeline_with_fsdp_inside_stages():
    pipe = _pipe("pp=2,fsdp=2", "1f1b", parallelize=target("examples/llama.py:parallelize"))
    assert [s.profile.parallel.mesh.world_size for s in pipe.stages] == [2, 2]
    assert all(s.profile.parallel.rows for s in pipe.stages)  # FSDP2's all-gathers and reduce-scatters per stage


def test_more_stages_than_blocks_is_a_usage_error():
    r = CliRunner().invoke(cli, ["profile", str(ROOT / "examples/llama.py") + ":Llama", "--mesh", "pp=3",
                                 "--pp-split", str(ROOT / SPLIT.replace(":", ":", 1))], catch_exceptions=False)
    assert r.exit_code == 2 and "more pipeline stages than the model has repeated blocks (2)" in (r.stderr if hasattr(r, "stderr") else r.output)

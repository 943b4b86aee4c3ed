"""--mesh: the collectives fxacct finds on the traced rank are exactly those the engine issues in
an eager run of the same model and parallelize function (tests/parallel_oracle.py: real CPU
tensors under the fake process group, a dispatch counter and CommDebugMode), and closed forms
for their counts and bytes."""

from __future__ import annotations

import pytest
import torch
from helpers import target
from parallel_oracle import eager_collectives, fxacct_collectives, load

import fxacct
from fxacct.report import document

LLAMA = "examples/llama.py:Llama"
LLAMA_KW = {}  # vocab 512, dim 64, 2 layers, 4 heads, 2 kv heads, hidden 128, T=64
GPT = "examples/gpt2.py:GPT"
GPT_KW = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1001, block_size=32)
BATCH = 2


def _fsdp_only(model, mesh):
    """FSDP2 per repeated block and at the root: what fxacct applies itself for --mesh fsdp=N."""
    from torch.distributed.fsdp import fully_shard

    from fxacct.parallel.engine import repeated_blocks

    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh["fsdp"])
    fully_shard(model, mesh=mesh["fsdp"], reshard_after_forward=False)
    return model


def _profile(rel, kwargs, mesh, parallelize=None):
    cfg = fxacct.Config(target=target(rel), batch=BATCH, kwargs=dict(kwargs), mesh=mesh,
                        parallelize=target(parallelize) if parallelize else None)
    return fxacct.profile(cfg)


def _inputs(rel, kwargs):
    if rel == LLAMA:
        return (torch.randint(0, 512, (BATCH, 64)),)
    return (torch.randint(0, kwargs["vocab_size"], (BATCH, kwargs["block_size"])),)


CASES = [
    (LLAMA, LLAMA_KW, {"fsdp": 4}, "examples/llama.py:parallelize"),
    (LLAMA, LLAMA_KW, {"tp": 2}, "examples/llama.py:parallelize"),
    (LLAMA, LLAMA_KW, {"fsdp": 2, "tp": 2}, "examples/llama.py:parallelize"),
    (LLAMA, LLAMA_KW, {"tp": 2}, "examples/llama.py:parallelize_sp"),
    (GPT, GPT_KW, {"fsdp": 4}, None),
    (GPT, GPT_KW, {"fsdp": 2}, None),
]


@pytest.mark.parametrize("rel,kwargs,dims,par", CASES, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_collectives_equal_the_engines(rel, kwargs, dims, par):
    mesh = ",".join(f"{k}={v}" for k, v in dims.items())
    p = _profile(rel, kwargs, mesh, par)
    got_count, got_bytes = fxacct_collectives(document(p))
    cls = load(rel)
    fn = load(par) if par else _fsdp_only
    count, nbytes, comm = eager_collectives(lambda: cls(**kwargs), fn, dims, _inputs(rel, kwargs))
    assert got_count == count, (got_count, count)
    assert got_bytes == nbytes, (got_bytes, nbytes)
    # CommDebugMode, torch's own counter, agrees on the functional collectives it reports
    for name, op in (("all_reduce", "all_reduce"), ("all_gather_into_tensor", "all_gather")):
        if name in comm and op == "all_reduce":
            assert comm[name] == count[op]


def test_llama_tp2_closed_form():
    """tp=2 on the llama example: per block, forward all-reduces the outputs of wo and w2 (the
    two row-wise layers: 2); backward all-reduces the input gradient of every column-wise layer
    separately (wq, wk, wv, w1, w3: 5). The root adds the embedding's forward all-reduce (row-wise
    on vocab) and the output projection's backward one, and one all-gather of the logits
    (column-wise output made Replicate). 2 blocks: 2·(2+5) + 2 = 16 all-reduces, each of the
    activation (B, T, dim) = 2·64·64·4 B = 32768 B; at n=2 the ring sends 2(n−1)/n·S = S each.
    The logits all-gather: (B, T, vocab) = 2·64·512·4 = 262144 B, of which (n−1)/n = 131072 on
    the wire."""
    d = document(_profile(LLAMA, LLAMA_KW, "tp=2", "examples/llama.py:parallelize"))
    ar = [c for c in d["collectives"] if c["op"] == "all_reduce"]
    assert sum(c["count"] for c in ar) == 16
    assert sum(c["count"] for c in ar if c["phase"] == "forward") == 2 * 2 + 1
    assert {c["bytes"] // c["count"] for c in ar} == {32768}
    assert sum(c["wire_bytes"] for c in ar) == 16 * 32768
    ag = [c for c in d["collectives"] if c["op"] == "all_gather"]
    assert [(c["count"], c["bytes"], c["wire_bytes"]) for c in ag] == [(1, 262144, 131072)]
    assert d["totals"]["comm_wire_bytes"] == 16 * 32768 + 131072


def test_llama_fsdp4_closed_form():
    """fsdp=4, reshard after forward: all-gathers = forward (root + 2 blocks) + backward (2 blocks;
    the root stays gathered) = 5, in the param dtype (fp32); reduce-scatters once per unit = 3.
    Unit sizes: a block has 64 + 4096 + 2048 + 2048 + 4096 + 64 + 3·8192 = 36992 parameters =
    147968 B; the root tok_embeddings 512·64 + norm 64 + output 512·64 = 65600 = 262400 B. Every
    dim 0 divides by 4, so no padding. Gathered bytes: 262400 + 4·147968 = 854272; wire (n−1)/n of
    that = 640704. Reduce-scatter outputs are the shards: (262400 + 2·147968)/4 = 139584 B, and
    send (n−1)/n of their inputs: 3·139584 = 418752."""
    d = document(_profile(LLAMA, LLAMA_KW, "fsdp=4", "examples/llama.py:parallelize"))
    by = {}
    for c in d["collectives"]:
        acc = by.setdefault((c["op"], c["phase"]), [0, 0, 0])
        acc[0] += c["count"]
        acc[1] += c["bytes"]
        acc[2] += c["wire_bytes"]
    assert by[("all_gather", "forward")][0] == 3 and by[("all_gather", "backward")][0] == 2
    assert by[("all_gather", "forward")][1] + by[("all_gather", "backward")][1] == 854272
    assert by[("all_gather", "forward")][2] + by[("all_gather", "backward")][2] == 640704
    assert by[("reduce_scatter", "backward")] == [3, 139584, 418752]
    assert d["totals"]["param_bytes"] == 139584 and d["totals"]["grad_bytes"] == 139584


def test_no_reshard_after_forward_gathers_once():
    """--no-reshard-after-forward keeps the blocks gathered from forward to backward: the 2
    backward all-gathers disappear, leaving 3 (root + 2 blocks)."""
    cfg = fxacct.Config(target=target(LLAMA), batch=BATCH, mesh="fsdp=4", reshard_after_forward=False,
                        kwargs={"n_heads": 4})
    # the llama example's own plan is not used: fxacct applies FSDP2 itself (no tp)
    d = document(fxacct.profile(cfg))
    assert sum(c["count"] for c in d["collectives"] if c["op"] == "all_gather") == 3


def test_hugging_face_plan_collectives_equal_the_engines():
    """No --parallelize: fxacct applies the plan the model carries (transformers' base_model_tp_plan
    and _tp_plan) on tp and FSDP2 on fsdp; the same parallelization run eagerly issues the same
    collectives."""
    pytest.importorskip("transformers")
    from fxacct.load.mesh import parse_mesh
    from fxacct.parallel.engine import parallelize

    rel = "tests/models/hf_llama_tp.py:make"
    cfg = fxacct.Config(target=target(rel), batch=BATCH, mesh="fsdp=2,tp=2")
    got_count, got_bytes = fxacct_collectives(document(fxacct.profile(cfg)))
    make = load(rel)
    count, nbytes, _ = eager_collectives(make, lambda m, mesh: parallelize(m, parse_mesh("fsdp=2,tp=2"), mesh, cfg),
                                         {"fsdp": 2, "tp": 2}, (torch.randint(0, 256, (BATCH, 32)),))
    assert (got_count, got_bytes) == (count, nbytes)
    assert got_count["all_reduce"] == 16  # 2 blocks × (2 forward + 5 backward) + embedding + lm_head


def test_blocks_with_repeated_parts_are_sharded_once(tmp_path):
    """A Sequential of two Sequential(Linear(16, 32), ReLU, Linear(32, 16)) blocks: the default
    FSDP2 wrapping shards each block, not also the Linears repeated inside it (that wrapped a
    child after its parent and failed). Each block gathers (16·32 + 32 + 32·16 + 16) · 4 = 4288 B
    in forward, and again in backward; it reduce-scatters 4288 / 2 = 2144 B; the root holds no
    parameter of its own, so it makes no unit."""
    (tmp_path / "nested.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n"
        "    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))\n"
        "                           for _ in range(2)])\n\n"
        "def example_inputs(batch):\n"
        "    return (torch.randn(batch, 16),)\n")
    p = fxacct.profile(fxacct.Config(target=str(tmp_path / "nested.py") + ":make", batch=4, mesh="fsdp=2"))
    by = {}
    for r in p.parallel.rows:
        acc = by.setdefault((r.op, r.phase), [0, 0])
        acc[0] += r.count
        acc[1] += r.bytes
    assert by == {("all_gather", "forward"): [2, 2 * 4288], ("all_gather", "backward"): [2, 2 * 4288],
                  ("reduce_scatter", "backward"): [2, 2 * 2144]}


def test_gloo_reduce_scatter_note_only_where_a_rank_measured_over():
    """The real-run table explains a peak over the prediction by gloo's reduce-scatter (a full
    copy of its input) only where a rank measured over it and reduce-scatters ran."""
    from types import SimpleNamespace

    from fxacct.parallel.collectives import CollectiveRow
    from fxacct.report.collectives import GLOO_REDUCE_SCATTER, render_ranks
    from fxacct.runtime.gloo_run import RankMeasured

    rows = (CollectiveRow("reduce_scatter", "fsdp", "backward", "layers.0", 3, 300, 150),)
    parallel = SimpleNamespace(rows=rows, pipeline=None, mesh="fsdp=2")
    note = GLOO_REDUCE_SCATTER.split()[:4]

    def rendered(peak: int, collectives: dict) -> str:
        ranks = [RankMeasured(r, 10.0, peak, collectives) for r in (0, 1)]
        return " ".join(render_ranks(parallel, ranks, 1000, width=200).split())

    assert " ".join(note) in rendered(1062, {"reduce_scatter": [3, 300]})  # 6.2% over
    assert " ".join(note) not in rendered(1000, {"reduce_scatter": [3, 300]})  # equal
    assert " ".join(note) not in rendered(1062, {"all_reduce": [3, 300]})  # over, but no reduce-scatter

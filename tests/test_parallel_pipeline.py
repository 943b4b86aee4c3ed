"""--mesh pp=P: per-stage accounts, the schedule's order (in-flight micro-batches and the bubble
against their closed forms), split points (FQNs, balanced), send/recv volume, usage errors.
The per-stage peak itself is held against the real gloo run in test_parallel_gloo.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import ROOT, target
from parallel_oracle import load

import fxacct
from fxacct.parallel.pipeline_schedule import releases, simulate
from fxacct.parallel.pipeline_split import balanced_cuts
from fxacct_cli.main import cli

LLAMA = "examples/llama.py:Llama"
SPLIT = "examples/llama.py:pipeline_stage"
KW = {"n_layers": 4}  # dim 64, vocab 512, T = 64
GPT = "examples/gpt2.py:GPT"
GPT_KW = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1001, block_size=32)


def _pipe(mesh, schedule, m=4, split=target(SPLIT), model=LLAMA, kwargs=KW, **kw):
    cfg = fxacct.Config(target=target(model), batch=2, kwargs=dict(kwargs), mesh=mesh, pp_split=split,
                        microbatches=m, pp_schedule=schedule, **kw)
    return fxacct.profile(cfg).parallel.pipeline


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 3), (4, 5)])
def test_schedule_order_against_closed_forms(p, m):
    """From torch's own per-rank order: 1F1B holds min(P − s, M) micro-batches on stage s (it
    starts with P − s forwards, then alternates B and F), GPipe all M. Both idle
    (P − 1)/(M + P − 1) of the step: each stage computes M · (t_F + t_B), and the step spans
    (M + P − 1) · (t_F + t_B), P − 1 forward slots of fill before the last stage starts and
    P − 1 backward slots of drain after the first stage could finish."""
    for schedule, expected in (("1f1b", [min(p - s, m) for s in range(p)]), ("gpipe", [m] * p)):
        orders = simulate(schedule, p, m)
        assert [o.in_flight for o in orders] == expected
        for o in orders:
            assert sorted((k, mb) for k, _, mb in o.actions) == sorted((k, mb) for k in "FB" for mb in range(m))
            assert 1 - o.busy / o.span == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (2, 3, 4)])
def test_interleaved_order_against_closed_forms(p, v, m):
    """Interleaved 1F1B with V stages per rank (Narayanan et al. 2021, Megatron-LM; M a multiple
    of P): rank r warms up with 2(P − 1 − r) + (V − 1)·P forwards of (stage, micro-batch), then
    alternates, so it holds min(V·M, that + 1) of them; the bubble shrinks by V: each rank computes
    V·M·(t_F + t_B) of (V·M + P − 1)·(t_F + t_B), t_F, t_B per stage."""
    orders = simulate("interleaved-1f1b", p, m, v)
    assert [o.in_flight for o in orders] == [min(v * m, 2 * (p - 1 - r) + (v - 1) * p + 1) for r in range(p)]
    for r, o in enumerate(orders):
        assert sorted(o.actions) == sorted((k, s, mb) for k in "FB" for s in range(r, p * v, p) for mb in range(m))
        assert 1 - o.busy / o.span == pytest.approx((p - 1) / (v * m + p - 1))


def test_releases_follow_the_1f1b_sends():
    """pp=2, M=4, stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3 (actions 0..7): output k is freed after B(k)
    (actions 2, 4, 6, 7), but output 0's send work (W − 2 = 0 with W = 2 warm-up forwards) lives to
    the end of the steady loop, B2 (action 6). Stage 1 runs F0 B0 F1 B1 ... : input gradient k
    leaves with B(k + 1) (actions 3, 5, 7), the last when the schedule returns (8)."""
    o0, o1 = simulate("1f1b", 2, 4)
    assert [(k, mb) for k, _, mb in o0.actions] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                                    ("B", 2), ("B", 3)]
    assert releases("1f1b", o0.actions, 2, 0, 4)[0] == {(0, 0): 6, (0, 1): 4, (0, 2): 6, (0, 3): 7}
    assert releases("1f1b", o1.actions, 2, 1, 4)[1] == {(1, 0): 3, (1, 1): 5, (1, 2): 7, (1, 3): 8}
    everything = {(1, k): 8 for k in range(4)}  # GPipe: every send's work is held until the schedule returns
    assert releases("gpipe", o1.actions, 2, 1, 4) == (everything, everything)


def test_in_flight_and_bubble_in_the_account():
    for schedule, expected in (("1f1b", [2, 1]), ("gpipe", [4, 4])):
        pipe = _pipe("pp=2", schedule)
        assert [s.in_flight for s in pipe.stages] == expected
        assert pipe.bubble_fraction == pytest.approx(1 / 5)  # (P − 1) / (M + P − 1) = 1 / 5
        for s in pipe.stages:  # holding more micro-batches never lowers the peak below one's
            assert s.peak_bytes >= s.profile.memory.peak_train.bytes


def test_interleaved_ranks_hold_two_stages_each():
    """pp=2, V=2 on 4 layers: stages 0 (embedding + layer 0) and 2 (layer 2) on rank 0, 1 and 3
    (layer 3 + norm + output) on rank 1. Rank 0 sends stage 0's and stage 2's output and stage 2's
    input gradient, each (2, 64, 64) fp32 = 32768 B per micro-batch: 3 · 4 · 32768 = 393216 B; in
    flight 5 and 3, bubble (P − 1)/(V·M + P − 1) = 1/9."""
    pipe = _pipe("pp=2", "interleaved-1f1b", pp_stages_per_rank=2)
    assert [s.stages_on_rank for s in pipe.stages] == [(0, 2), (1, 3)]
    assert [s.in_flight for s in pipe.stages] == [5, 3]
    assert [s.send_bytes for s in pipe.stages] == [393216, 393216]
    assert pipe.bubble_fraction == pytest.approx(1 / 9)
    assert [s.profile.accounting.totals.params for s in pipe.stages] == [32768 + 36992, 36992]
    # what each rank holds: both its stages (the summary's "per rank" and JSON's "params" said the
    # first stage's alone): rank 0 the embedding and layers 0 and 2, rank 1 layers 1 and 3, the
    # final norm and the output
    assert [s.params for s in pipe.stages] == [32768 + 2 * 36992, 2 * 36992 + 64 + 32768]
    assert [s.param_bytes for s in pipe.stages] == [4 * s.params for s in pipe.stages]


def test_the_summary_and_json_give_an_interleaved_ranks_parameters():
    args = ["profile", LLAMA, "--batch", "2", "-k", "n_layers=4", "--mesh", "pp=2", "--pp-split", SPLIT,
            "--pp-schedule", "interleaved-1f1b", "--microbatches", "2"]
    r = CliRunner().invoke(cli, [*args, "--summary"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "per rank (rank 0's shards of stages 0, 2) 106.752k (106,752)" in r.output
    r = CliRunner().invoke(cli, [*args, "--format", "json"], catch_exceptions=False)
    stages = json.loads(r.stdout)["pipeline"]["stages"]
    assert [s["params"] for s in stages] == [32768 + 2 * 36992, 2 * 36992 + 64 + 32768]


def test_stages_partition_the_model():
    """The stages hold every parameter once: tok_embeddings 512·64 + 2 blocks · 36992 on stage 0,
    2 blocks · 36992 + norm 64 + output 512·64 on stage 1 (1 + 4·36992 + ... = the whole model).
    Each boundary moves the (B, T, dim) = 2·64·64 fp32 activation, 32768 B, per micro-batch each
    way: 4 · 32768 = 131072 B sent per step by each of the two stages. The same stages come from
    the split function, the FQN where stage 1 begins, and the balanced split (4 equal blocks)."""
    with torch.device("meta"):
        full = load(LLAMA)(**KW)
    for split in (target(SPLIT), "layers.2", None):
        pipe = _pipe("pp=2", "1f1b", split=split)
        assert sum(s.profile.accounting.totals.params for s in pipe.stages) == sum(p.numel() for p in full.parameters())
        assert [s.profile.accounting.totals.params for s in pipe.stages] == [32768 + 2 * 36992, 2 * 36992 + 64 + 32768]
        assert [s.send_bytes for s in pipe.stages] == [131072, 131072]


def test_gpt2_splits_without_a_split_function():
    """GPT-2 (2 blocks of 49984 parameters: ln 128 + c_attn 12480 + c_proj 4160 + ln 128 + c_fc
    16640 + c_proj 16448) cut at h.1 by torch.distributed.pipelining.pipeline: stage 0 holds wte
    1001·64 + wpe 32·64 + h.0, and the tied lm_head weight that pipeline() copies to every stage
    that has one of its names (1001·64, unused there); stage 1 holds h.1 + ln_f 128 + lm_head."""
    pipe = _pipe("pp=2", "1f1b", split=None, model=GPT, kwargs=GPT_KW)
    assert [s.profile.accounting.totals.params for s in pipe.stages] == [64064 + 2048 + 49984 + 64064,
                                                                         49984 + 128 + 64064]
    assert [s.send_bytes for s in pipe.stages] == [4 * 2 * 32 * 64 * 4] * 2


def test_balanced_cuts():
    """Blocks 4, 4, 4, 4 with 6 before and 2 after, 2 stages: cutting at 2 gives 6+8 = 14 and
    8+2 = 10; at 1: 10 and 14; at 3: 18 and 6, so 1 and 2 tie at 14 and the first found (1) wins.
    With 3 stages and costs 1..6 (sum 21), no pre/post: [1,2,3,4] [5] [6] costs 10, 5, 6 → 10;
    [1,2,3] [4,5] [6] → 6, 9, 6 → 9, the best."""
    assert balanced_cuts(6, [4, 4, 4, 4], 2, 2) == [1]
    assert balanced_cuts(0, [1, 2, 3, 4, 5, 6], 0, 3) == [3, 5]
    assert balanced_cuts(0, [5, 5], 0, 2) == [1]


def test_pipeline_with_fsdp_inside_stages():
    pipe = _pipe("pp=2,fsdp=2", "1f1b", parallelize=target("examples/llama.py:parallelize"))
    assert [s.profile.parallel.mesh.world_size for s in pipe.stages] == [2, 2]
    assert all(s.profile.parallel.rows for s in pipe.stages)  # FSDP2's all-gathers and reduce-scatters per stage


def test_fsdp_units_found_in_a_stage_trace():
    """What the stage replay reads of FSDP2 in stage 0's trace (tok_embeddings + layers.0-1, one
    unit each): per block 9 parameters (wq, wk, wv, wo, w1, w2, w3 and two norms), for the root the
    embedding, so 9 + 9 + 1 unsharded storages and as many unsharded gradients, in three reductions
    (the trace's backward order: layers.1, layers.0, the root); an all-gather buffer per gather
    (forward: 3, backward: the 2 blocks resharded after forward) fills one unit."""
    import operator

    from fxacct.memory.peak import lifetimes
    from fxacct.parallel.pipeline_fsdp import fsdp_stage
    from fxacct.parallel.pipeline_memory import _storages_born

    pipe = _pipe("pp=2,fsdp=2", "1f1b", parallelize=target("examples/llama.py:parallelize"))
    stage = pipe.stages[0].profile
    ops, born = _storages_born(stage.capture, lifetimes(stage.capture))
    births = {}
    for entry in born:
        births.setdefault(entry[1], []).append(entry)
    found = fsdp_stage(ops, births, stage.parallel.resizes)
    assert [len(r.grads) for r in found.regions] == [9, 9, 1]
    assert len(found.events) == 19 and found.grads.isdisjoint(found.events)
    units = [u for u in found.buffers.values()]
    assert sorted(len(u) for u in units) == [1, 9, 9, 9, 9]
    assert all(not r.cast for r in found.regions)  # fp32 throughout: nothing accumulates in another dtype
    assert all(ops[r.ops[0]].target is torch.ops.aten.empty.memory_format for r in found.regions)
    assert fsdp_stage(ops, births, ()) is None and operator.getitem not in {n.target for n in ops}


def _usage(*args):
    r = CliRunner().invoke(cli, ["profile", str(ROOT / "examples/llama.py") + ":Llama", *args], catch_exceptions=False)
    out = r.stderr if hasattr(r, "stderr") else r.output
    assert r.exit_code == 2, out
    assert len(out.strip().splitlines()) == 1, out
    return out


def test_more_stages_than_blocks_is_a_usage_error():
    assert "more pipeline stages than the model has repeated blocks (2)" in _usage(
        "--mesh", "pp=3", "--pp-split", str(ROOT / SPLIT))


def test_unknown_split_fqn_is_a_usage_error():
    # the example names one FQN for two stages, the middle block of the default llama's 2
    assert "the model has no module 'layers.7'; give the 1 FQN where stages begin, such as layers.1" in _usage(
        "--mesh", "pp=2", "--pp-split", "layers.7")


def test_too_few_microbatches_for_1f1b_is_a_usage_error():
    assert "--microbatches 1 is fewer than the 2 pipeline stages" in _usage("--mesh", "pp=2", "--microbatches", "1")


def test_stages_per_rank_needs_the_interleaved_schedule():
    assert "--pp-stages-per-rank 2 goes with --pp-schedule interleaved-1f1b" in _usage(
        "--mesh", "pp=2", "--pp-stages-per-rank", "2")
    # one stage per rank is 1F1B (torch's interleaved schedule took it, and fxacct's replay of it failed: exit 4)
    for v in ("1", "0"):
        assert f"--pp-stages-per-rank {v}: interleaved 1F1B runs 2 or more stages per rank (one stage per rank is " \
            "--pp-schedule 1f1b)" in _usage("--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b",
                                            "--pp-stages-per-rank", v)


def test_interleaved_microbatches_in_whole_rounds():
    """M = 5 at pp=2: 2 rounds of 2, and 5 is not a multiple of 2."""
    assert "is not a multiple of its 2 rounds" in _usage(
        "-k", "n_layers=4", "--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b", "--microbatches", "5")


def test_interleaved_stages_beyond_the_blocks_is_a_usage_error():
    """The default llama has 2 layers: pp=2 with 2 stages per rank needs 4. The fix offered is 1F1B
    (it said "use pp <= 1": no pipeline at all; then "--pp-stages-per-rank 1", which interleaving refuses);
    at 6 layers and pp=2 with 4 stages per rank, 3 stages per rank."""
    assert "pp=2 with 2 stages per rank asks for more pipeline stages than the model has repeated blocks (2): " \
        "use --pp-schedule 1f1b" in _usage("--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b")
    assert "pp=2 with 4 stages per rank asks for more pipeline stages than the model has repeated blocks (6): " \
        "use --pp-stages-per-rank 3 or --pp-schedule 1f1b" in _usage(
            "-k", "n_layers=6", "--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "4")


def test_split_points_must_match_the_stage_count():
    assert "gives 3 stages but --mesh has pp=2: give 1 FQN where stages begin" in _usage(
        "-k", "n_layers=4", "--mesh", "pp=2", "--pp-split", "layers.1,layers.2")


def test_a_stage_passing_several_tensors_sends_each_and_gradients_only_where_they_flow():
    """A Hugging Face Llama (tests/models/hf_llama_tp.py: 2 layers, hidden 64, 4 heads of 16, T = 32)
    cut at model.layers.1 passes, per micro-batch of 2: the hidden states (2, 32, 64) fp32 = 16384 B,
    which require grad, RoPE's cos and sin (1, 32, 16) fp32 = 2048 B each and the causal mask
    (2, 1, 32, 32) bool = 2048 B, which do not (rotary runs under no_grad; a mask is no float).
    Forward 4 tensors, 22528 B; backward only the hidden states' gradient, 16384 B. Over M = 4:
    stage 0 sends 16 tensors, 90112 B, and receives 4 gradients, 65536 B; stage 1 the mirror."""
    pytest.importorskip("transformers")
    cfg = fxacct.Config(target=str(ROOT / "tests/models/hf_llama_tp.py") + ":make", batch=2, mesh="pp=2",
                        microbatches=4)
    pipe = fxacct.profile(cfg).parallel.pipeline
    first, second = pipe.stages
    assert (first.sends, first.send_bytes, first.recvs, first.recv_bytes) == (16, 90112, 4, 65536)
    assert (second.sends, second.send_bytes, second.recvs, second.recv_bytes) == (4, 65536, 16, 90112)
    # stage 1 receives the hidden states requiring grad (its input gradient is computed and sent
    # back), cos, sin and the mask not
    inputs = [n.meta["val"] for n in second.profile.capture.input_nodes]
    assert [t.requires_grad for t in inputs] == [True, False, False, False]


def test_a_skip_connection_is_a_usage_error():
    """Cut in three, a Hugging Face Llama's stage 2 reads RoPE's cos and sin and the mask from stage
    0 (computed once, before the layers): torch's pipelining cannot run that; exit 2, one line."""
    pytest.importorskip("transformers")
    r = CliRunner().invoke(cli, ["profile", str(ROOT / "tests/models/hf_llama_tp.py") + ":make", "--batch", "2",
                                 "--mesh", "pp=3", "-k", "layers=3"], catch_exceptions=False)
    out = r.stderr if hasattr(r, "stderr") else r.output
    assert r.exit_code == 2, out
    assert "pipeline stage 2 reads tensors made by stage 0, not only by stage 1" in out and "--pp-split" in out, out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("columns", [80, 100])
def test_pipeline_report_fits_the_terminal_and_stderr_stays_quiet(columns):
    # the per-stage table leaves optional columns out rather than folding numbers across lines, and
    # torch.export's deprecation notices (the automatic split runs it) do not reach the user
    gpt = str(ROOT / "examples/gpt2.py") + ":GPT"
    args = ["-k", "n_layer=2", "-k", "n_embd=64", "-k", "n_head=4", "-k", "vocab_size=1001", "-k", "block_size=32",
            "--batch", "2", "--mesh", "pp=2", "--microbatches", "4", "--gpu", "h100"]
    r = CliRunner().invoke(cli, ["profile", gpt, *args], env={"COLUMNS": str(columns)}, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    # a stage row keeps every figure it shows whole: stage, ..., in flight, peak, send, recv
    for row in lines[at + 2:at + 4]:
        assert row.split()[0] in ("0", "1") and row.rstrip().endswith("KiB"), row


@pytest.mark.slow  # test_stages_partition_the_model keeps pp fast
def test_fsdp_on_a_cut_stage_wraps_each_of_its_blocks():
    """pp=2,fsdp=2 on a 4-layer Hugging Face Llama cut automatically at model.layers.2: stage 0's
    module (pipeline()'s own, its blocks still named model.layers.0 and .1) gets FSDP2 per block
    and at its root, as on the uncut model. Forward: 3 all-gathers (root, 2 blocks); backward the
    2 blocks again (resharded after forward; the root is kept, as torchtitan does); 3 reduce-scatters."""
    pytest.importorskip("transformers")
    cfg = fxacct.Config(target=str(ROOT / "tests/models/hf_llama_tp.py") + ":make", kwargs={"layers": 4}, batch=2,
                        mesh="pp=2,fsdp=2", microbatches=4)
    rows = fxacct.profile(cfg).parallel.pipeline.stages[0].profile.parallel.rows
    count = {}
    for r in rows:
        count[r.op, r.phase] = count.get((r.op, r.phase), 0) + r.count
    assert count == {("all_gather", "forward"): 3, ("all_gather", "backward"): 2, ("reduce_scatter", "backward"): 3}


@pytest.mark.slow  # test_stages_partition_the_model keeps pp fast
def test_own_parallelize_on_automatically_cut_stages(tmp_path):
    """--parallelize with pp=2,fsdp=2 and no --pp-split: the balanced split traces the whole model on
    one device first (it once refused, as if --parallelize had come without --mesh). The function
    shards each block of the stage it is given and the stage's root: on stage 0 (tok_embeddings,
    layers.0, layers.1) forward gathers 3 units (root, 2 blocks), backward the 2 resharded blocks
    again, and 3 reduce-scatters."""
    (tmp_path / "par.py").write_text(
        "from torch.distributed.fsdp import fully_shard\n\n"
        "def parallelize(model, mesh):\n"
        "    for block in model.layers.children():\n"
        "        fully_shard(block, mesh=mesh['fsdp'])\n"
        "    fully_shard(model, mesh=mesh['fsdp'], reshard_after_forward=False)\n")
    pipe = _pipe("pp=2,fsdp=2", "1f1b", split=None, parallelize=str(tmp_path / "par.py") + ":parallelize")
    count = {}
    for r in pipe.stages[0].profile.parallel.rows:
        count[r.op, r.phase] = count.get((r.op, r.phase), 0) + r.count
    assert count == {("all_gather", "forward"): 3, ("all_gather", "backward"): 2, ("reduce_scatter", "backward"): 3}


def test_tensor_parallel_needs_a_split_function():
    """An exported stage (GraphModule of InterpreterModules, reshapes fixed to all heads) cannot
    take torch's tensor-parallel styles: refused before any trace, naming the way that works."""
    out = _usage("-k", "n_layers=4", "--mesh", "pp=2,tp=2",
                 "--parallelize", str(ROOT / "examples/llama.py:parallelize"))
    assert "tensor parallelism cannot shard those traced graphs" in out and "--pp-split PATH.py:fn" in out


def test_a_models_own_loss_under_pp_is_a_usage_error():
    assert "with --loss model: a pipeline's stages are cut from the model's forward" in _usage(
        "-k", "n_layers=4", "--mesh", "pp=2", "--loss", "model")


def test_parallelize_with_pp_alone_is_a_usage_error():
    assert "--parallelize with --mesh pp=2: the function shards each pipeline stage over the other mesh" in _usage(
        "--mesh", "pp=2", "--parallelize", str(ROOT / "examples/llama.py:parallelize"))


def test_a_model_without_repeated_blocks_needs_its_split_named(tmp_path):
    """An LSTM language model has no stack of blocks to balance: the automatic split is a usage
    error naming --pp-split; with the FQN where stage 1 begins (its head) it is accounted: stage 0
    sends the LSTM's output, (2, 16, 64) fp32 = 8192 B per micro-batch, and receives its gradient."""
    (tmp_path / "lstm.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class LSTMLM(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.lstm, self.head = nn.Embedding(256, 64), nn.LSTM(64, 64, 2, batch_first=True), "
        "nn.Linear(64, 256)\n"
        "    def forward(self, x):\n"
        "        return self.head(self.lstm(self.emb(x))[0])\n"
        "    def example_inputs(self, batch):\n"
        "        return (torch.randint(0, 256, (batch, 16)),)\n")
    target = str(tmp_path / "lstm.py") + ":LSTMLM"
    r = CliRunner().invoke(cli, ["profile", target, "--batch", "2", "--mesh", "pp=2"], catch_exceptions=False)
    assert r.exit_code == 2 and "no repeated blocks to cut between automatically" in r.stderr, r.output
    assert "--pp-split" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    pipe = fxacct.profile(fxacct.Config(target=target, batch=2, mesh="pp=2", pp_split="head", microbatches=2)
                          ).parallel.pipeline
    assert [(s.sends, s.send_bytes) for s in pipe.stages] == [(2, 2 * 8192), (2, 2 * 8192)]


def test_pipeline_summary_says_what_is_one_micro_batch_and_what_is_the_step():
    """Under pp the account is stage 0's for one micro-batch: the summary's FLOPs say so, its config
    gives micro-batch × M, its peak is rank 0's over the step (the replay held against gloo in
    test_parallel_gloo), beside the largest rank's and the one-micro-batch figure it once gave
    alone, and its step time is the whole step's, with the pipeline's tokens: M · B · T = 4 · 2 · 64
    = 512 tokens a step (it once gave one micro-batch of stage 0, with no throughput)."""
    from fxacct.predict.fused_time import predict_profile
    from fxacct.report.summary_text import exact_bytes, render_summary

    cfg = fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(KW), mesh="pp=2", pp_split=target(SPLIT),
                        microbatches=4, gpu="h100", find_max_batch=False)
    p = fxacct.profile(cfg)
    pipe = p.parallel.pipeline
    text = render_summary(p, predict_profile(p))
    assert "micro-batch 2 × 4 per step (1f1b)" in text
    assert " per micro-batch of stage 0 = forward" in text and " per step =" not in text
    assert f"training step, rank 0 {exact_bytes(pipe.stages[0].peak_bytes)} (2 micro-batches in flight)" in text
    step = next(line for line in text.splitlines() if "step time" in line)
    assert "the whole step: 4 micro-batches through 2 stages" in step, step
    assert "predicted on NVIDIA H100 SXM5 80GB, the whole step" in step, step  # the device's name, as without pp
    from fxacct.report.durations import format_ms
    from fxacct.report.summary_text import _rate

    assert format_ms(1e3 * pipe.step_s) in step and f"{_rate(512 / pipe.step_s)} tokens/s per pipeline" in step
    # what rank 0 sends in a step: 4 micro-batches of its (2, 64, 64) fp32 output, 4 · 32768 B
    # (pp alone: no collective), once reported as 0
    from fxacct.report import document

    assert document(p)["totals"]["comm_wire_bytes"] == 4 * 32768


def test_only_the_last_stage_takes_the_loss():
    """torch's pipelining runs loss_fn on the last stage alone; an earlier stage receives its
    output's gradient. So stage 0's account is the same under --loss cross-entropy as under sum
    (it once took a cross-entropy over its hidden states: their 64 "classes"), while the last
    stage's account changes (the loss and its gradient over the logits)."""
    pipes = {loss: _pipe("pp=2", "1f1b", loss=loss) for loss in ("sum", "cross-entropy")}
    first = [(p.stages[0].profile.accounting.totals, p.stages[0].peak_bytes) for p in pipes.values()]
    assert first[0] == first[1]
    last = [(p.stages[1].profile.accounting.totals, p.stages[1].peak_bytes) for p in pipes.values()]
    assert last[0] != last[1]


def _attention_ops(prof) -> set[str]:
    return {str(n.target) for n in prof.capture.graph.nodes
            if n.op == "call_function" and "scaled_dot_product" in str(n.target)}


def test_pipeline_stage_under_gpu_takes_the_gpu_attention_kernel():
    """An automatic split cuts stages with torch.export, which records attention as the aten op;
    under --gpu h100 the stage must still take the kernel a GPU runs (the memory-efficient one for
    fp32, as one device does: fxacct.trace.targets rule 1), not the CPU flash kernel."""
    cfg = dict(target=target(LLAMA), batch=2, kwargs=dict(KW), gpu="h100")
    one = fxacct.profile(fxacct.Config(**cfg))
    stage = fxacct.profile(fxacct.Config(**cfg, mesh="pp=2")).parallel.pipeline.stages[0].profile
    assert _attention_ops(one) == {"aten._scaled_dot_product_efficient_attention.default",
                                   "aten._scaled_dot_product_efficient_attention_backward.default"}
    assert _attention_ops(stage) == _attention_ops(one)


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 2, 4), ("1f1b", 4, 8), ("1f1b", 3, 3)])
def test_step_seconds_of_equal_stages_is_the_closed_form(schedule, p, m):
    """Equal stages (forward f, backward b per micro-batch) span (M + P − 1)·(f + b) under GPipe and
    1F1B: M slots of work on every rank plus P − 1 of fill and drain (Huang et al. 2019; Narayanan
    et al. 2021)."""
    from fxacct.parallel.pipeline_schedule import step_seconds

    f, b = 0.003, 0.007
    assert step_seconds(schedule, p, m, 1, [f] * p, [b] * p) == pytest.approx((m + p - 1) * (f + b))


def test_pipeline_whole_step_time_under_gpu():
    """--mesh pp=2 --gpu h100: the whole step is the schedule run with each stage's roofline time per
    micro-batch, then the slowest rank's optimizer. Bounds that hold for any two stages: each rank
    computes its M micro-batches, and the step is at most M + P − 1 slots of the slower stage."""
    from fxacct.predict.fused_time import predict_profile

    cfg = fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(KW), mesh="pp=2", microbatches=4, gpu="h100")
    prof = fxacct.profile(cfg)
    pipe = prof.parallel.pipeline
    phases = [predict_profile(s.profile).by_phase for s in pipe.stages]
    slot = [ph["forward"] + ph["loss"] + ph["backward"] for ph in phases]
    optimizer = max(ph["optimizer"] for ph in phases)
    assert 4 * max(slot) <= pipe.step_s - optimizer <= (4 + 2 - 1) * max(slot) + 1e-12
    from fxacct.report.summary_text import render_summary

    assert "the whole step: 4 micro-batches through 2 stages" in render_summary(prof, prof.prediction)
    assert fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(KW), mesh="pp=2",
                                        microbatches=4)).parallel.pipeline.step_s is None  # no device model


def test_a_sequence_parallel_stage_receives_its_senders_sequence_shard():
    """Under examples/llama.py:parallelize_sp a stage's output is its sequence shard, (2, 32, 64)
    fp32 at tp=2, T = 64: what the next stage receives and what crosses the boundary (16384 B per
    micro-batch each way), as the real gloo run measures (test_parallel_gloo.py). Stage 1 was
    traced on the whole sequence the unparallelized split passes, and failed (exit 3)."""
    pipe = _pipe("pp=2,tp=2", "1f1b", m=2, kwargs={"n_layers": 2}, parallelize=target("examples/llama.py:parallelize_sp"))
    assert [(s.send_bytes, s.recv_bytes) for s in pipe.stages] == [(2 * 16384, 2 * 16384)] * 2
    stage1 = pipe.stages[1].profile.capture
    shapes = [tuple(n.meta["val"].shape) for n in stage1.input_nodes if n.meta.get("val") is not None]
    assert (2, 32, 64) in shapes and (2, 64, 64) not in shapes

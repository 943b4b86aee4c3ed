"""--mesh on the command line: the JSON keys and the text table, and the one-line errors (exit 2
for a layout the model cannot take, exit 3 when the user's parallelize raises)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import ROOT, invoke_profile

from fxacct_cli.main import cli

LLAMA = str(ROOT / "examples/llama.py") + ":Llama"
PAR = str(ROOT / "examples/llama.py") + ":parallelize"


_invoke = invoke_profile


def test_json_has_mesh_collectives_and_wire_total():
    r = _invoke(LLAMA, "--batch", "2", "--mesh", "fsdp=2,tp=2", "--parallelize", PAR, "--format", "json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["mesh"] == {"dims": {"fsdp": 2, "tp": 2}, "world_size": 4, "rank": 0, "model_params": 139_584}
    assert d["config"]["world_size"] == 4 and d["config"]["mesh"] == "fsdp=2,tp=2"
    keys = {"op", "mesh_dim", "phase", "module", "count", "bytes", "wire_bytes", "predicted_ms"}
    assert d["collectives"] and all(set(c) == keys for c in d["collectives"])
    assert {c["mesh_dim"] for c in d["collectives"]} == {"fsdp", "tp"}
    assert d["totals"]["comm_wire_bytes"] == sum(c["wire_bytes"] for c in d["collectives"])
    # the row-wise embedding's mask (`a | b`, aten.__or__.Tensor) is costed as a bitwise op: nothing unknown
    assert d["unsupported_ops"] == {}
    assert {n["kind"] for n in d["nodes"]} <= {"input", "view", "copy", "compute", "inplace", "creation", "collective"}


def test_text_table_sums_to_its_total():
    r = _invoke(LLAMA, "--batch", "2", "--mesh", "tp=2", "--parallelize", PAR)
    assert r.exit_code == 0, r.stderr
    text = r.stdout[r.stdout.index("collectives of one step"):]
    lines = text.splitlines()[3:]
    rows = [line.split() for line in lines[:next(i for i, x in enumerate(lines) if x.startswith("total")) + 1]]
    counts = [int(row[3]) for row in rows if row[0] != "total"]
    total = next(row for row in rows if row[0] == "total")
    assert sum(counts) == int(total[1]) == 17  # 16 all-reduces + 1 all-gather (test_parallel_collectives)


@pytest.mark.parametrize("args,needle", [
    (["--mesh", "tp=3", "--parallelize", PAR], "tp=3 does not divide the model's n_heads=4"),
    (["--mesh", "fsdp=2,tp=2", "--world-size", "8"], "has 4 ranks but --world-size is 8"),
    (["--mesh", "tp=2,fsdp=2"], "outer to inner"),
    (["--mesh", "xp=2"], "fxacct has no mesh dimension 'xp'"),
    (["--mesh", "fsdp"], "'fsdp' is not NAME=SIZE"),
    # the pipeline's flags without pp would do nothing
    (["--pp-split", "layers.1"], "--pp-split says how a pipeline runs, but --mesh has no pp dimension"),
    (["--mesh", "fsdp=2", "--microbatches", "4"], "add one (e.g. --mesh pp=2,fsdp=2) or drop --microbatches"),
    # pp=1 is there but is no pipeline: it suggested --mesh pp=2,pp=1, which is refused
    (["--mesh", "pp=1,fsdp=2", "--microbatches", "2"], "pp=1 is no pipeline: give pp=2 or more (e.g. --mesh pp=2,fsdp=2)"),
    (["--mesh", "pp=1", "--pp-schedule", "gpipe"], "pp=1 is no pipeline: give pp=2 or more (e.g. --mesh pp=2) or drop"),
    # without --gpu no communication is timed: it was accepted silently under --mesh
    (["--mesh", "fsdp=2", "--gpus-per-node", "4"], "add --gpu NAME or drop --gpus-per-node"),
    # --parallelize wraps the model itself: fxacct's own wrapping flag changed nothing, silently
    (["--mesh", "fsdp=2", "--parallelize", PAR, "--no-reshard-after-forward"], "pass reshard_after_forward to fully_shard"),
    # a CUDA target beside a real run of CPU processes compares unlike things
    (["--mesh", "fsdp=2", "--runtime", "--device", "cpu", "--gpu", "h100"], "--gpu h100 is a CUDA target"),
    (["--mesh", "tp=2"], "carries no tensor-parallel plan"),
    (["--parallelize", PAR], "--parallelize needs --mesh"),
    (["--mesh", "fsdp=2", "--world-size", "2", "--shard", "zero3"], "--mesh and --shard zero3"),
    # without --world-size too: not "give --world-size N", which the next try would refuse
    (["--mesh", "fsdp=2", "--shard", "zero3"], "--mesh and --shard zero3"),
    # the optimizer's fp32 copies would be plain tensors beside DTensor shards (it crashed, exit 4)
    (["--mesh", "fsdp=2", "--dtype", "bf16", "--master-weights"], "use --amp bfloat16 instead of --dtype bfloat16"),
    (["--mesh", "tp=2", "--parallelize", PAR, "--dtype", "bf16", "--master-weights"], "use --amp bfloat16 instead"),
    # no MixedPrecisionPolicy of fxacct's under the user's own --parallelize: it said there was one
    (["--mesh", "fsdp=2", "--parallelize", PAR, "--dtype", "bf16", "--master-weights"],
     "bfloat16 compute; your --parallelize sets its own fully_shard policies)"),
    # the user's own low precision, not bf16 whatever it was
    (["--mesh", "fsdp=2", "--dtype", "fp16", "--master-weights"], "use --amp float16 instead of --dtype float16"),
    # the real pipeline run takes torch's plain step: it would print ratios against another step
    (["--mesh", "pp=2", "--runtime", "--device", "cpu", "--amp", "bf16"], "drop --amp for the real check"),
    (["--mesh", "pp=2", "--runtime", "--device", "cpu", "--loss", "cross-entropy"], "not what --loss cross-entropy"),
    (["--mesh", "pp=2", "--runtime", "--device", "cpu", "--checkpoint", "layers.*"], "drop --checkpoint for"),
    (["--mesh", "fsdp=2", "--runtime", "--device", "cpu", "--trace", "t.json"], "records no profiler trace"),
    # the ranks' measurements have no CSV, markdown or HTML form: they were silently written as the table
    (["--mesh", "fsdp=2", "--runtime", "--device", "cpu", "--format", "csv"], "use --format table or json"),
    (["--mesh", "fsdp=2", "--runtime", "--device", "cpu", "--format", "html"], "use --format table or json"),
    # it said "use --device cpu, without --inference" to a command that had --device cpu
    (["--mesh", "fsdp=2", "--runtime", "--device", "cpu", "--inference"], "the ranks run training steps only"),
    # tp alone leaves the norms plain tensors; AdamW(foreach=True), CUDA's default under --gpu, raises
    # on that mix in eager PyTorch too ("got mixed torch.Tensor and DTensor")
    (["--mesh", "tp=2", "--parallelize", PAR, "--gpu", "h100"], "mix DTensor and plain tensors"),
])
def test_usage_errors_are_one_line(args, needle):
    r = _invoke(LLAMA, *args)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plan_naming_a_missing_module(tmp_path):
    f = tmp_path / "planned.py"
    f.write_text("import torch\n"
                 "class M(torch.nn.Module):\n"
                 "    _tp_plan = {'proj': 'colwise', 'missing.*': 'rowwise'}\n"
                 "    def __init__(self):\n"
                 "        super().__init__(); self.proj = torch.nn.Linear(8, 8)\n"
                 "    def forward(self, x):\n"
                 "        return self.proj(x)\n"
                 "    @staticmethod\n"
                 "    def example_inputs(batch):\n"
                 "        return (torch.randn(batch, 8),)\n")
    r = _invoke(f"{f}:M", "--mesh", "tp=2")
    assert r.exit_code == 2 and "names 'missing.*', which is not a module of M" in r.stderr, r.stderr


def test_user_parallelize_raising_is_a_model_error(tmp_path):
    f = tmp_path / "par.py"
    f.write_text("def parallelize(model, mesh):\n    raise ValueError('my plan is broken')\n")
    r = _invoke(LLAMA, "--mesh", "fsdp=2", "--parallelize", f"{f}:parallelize")
    assert r.exit_code == 3 and "my plan is broken" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("source, flags, expected", [
    ("def parallelize(model):\n    return model\n", ("--mesh", "fsdp=2", "--parallelize"),
     "parallelize cannot be called as fn(model, mesh) (too many positional arguments)"),
    ("def stage(model, stage):\n    return model\n", ("--mesh", "pp=2", "--pp-split"),
     "stage cannot be called as fn(model, stage, stages) (too many positional arguments)"),
    ("def other(model, mesh):\n    return model\n", ("--mesh", "fsdp=2", "--parallelize"),
     "has no name 'missing'; functions defined there: other"),
], ids=["parallelize-signature", "pp-split-signature", "missing-function"])
def test_a_function_flag_that_cannot_be_called_as_documented_is_a_usage_error(tmp_path, source, flags, expected):
    """The user's function is called as docs/parallel.md says; one that cannot take those arguments, or
    that is not there, is a usage error naming the flag (it was an internal error, exit 4)."""
    f = tmp_path / "fns.py"
    f.write_text(source)
    name = "missing" if "missing" in expected else source.split("(")[0].split()[-1]
    r = _invoke(LLAMA, *flags, f"{f}:{name}")
    assert r.exit_code == 2 and flags[-1] in r.stderr and expected in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # spawns a gloo group
def test_a_real_mesh_run_failing_in_the_users_file_keeps_the_account_and_exits_3():
    """The model traces on fake tensors and raises on real ones: every rank of the gloo run fails in
    the user's file. The account is written first, then one line naming the rank, the error and
    the user's line; exit 3 (a model error)."""
    target = ROOT / "tests/models/runtime_raises.py"
    r = CliRunner().invoke(cli, ["profile", f"{target}:RuntimeRaises", "--batch", "2", "--mesh", "fsdp=2", "--runtime",
                                 "--device", "cpu", "--steps", "1", "--warmup", "0"])
    assert r.exit_code == 3, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, r.stderr
    assert err[0].startswith("error: the real run on gloo failed on rank "), err
    assert "ValueError: real tensors are refused on purpose" in err[0] and "runtime_raises.py:15 in forward" in err[0]
    assert "collectives of one step" in r.stdout  # the account stands


def test_a_rank_failing_in_fxacct_is_an_internal_error():
    from fxacct.errors import InternalError, ModelError
    from fxacct.runtime.gloo_run import rank_failure

    text = ('Traceback (most recent call last):\n  File "/x/site-packages/torch/multiprocessing/spawn.py", line 87, '
            'in _wrap\n  File "/repo/fxacct/parallel/gloo_run.py", line 130, in _measure\nKeyError: \'rank\'\n')
    err = rank_failure(1, text)
    assert isinstance(err, InternalError) and err.exit_code == 4
    assert "rank 1: KeyError: 'rank'" in str(err) and "gloo_run.py:130 in _measure" in str(err)
    torch_text = text.replace("/repo/fxacct/parallel/gloo_run.py", "/x/site-packages/torch/distributed/c10d.py")
    assert isinstance(rank_failure(0, torch_text), ModelError)


def test_mixed_dtypes_in_one_fsdp_unit_is_a_usage_error(tmp_path):
    """FSDP2 asserts one original dtype per unit; the root unit here holds a bf16 Linear beside a
    float32 one: a usage error naming the unit and the way out, not the engine's AssertionError."""
    f = tmp_path / "mixed.py"
    f.write_text("import torch\nfrom torch import nn\n\n"
                 "class Mixed(nn.Module):\n"
                 "    def __init__(self):\n"
                 "        super().__init__()\n"
                 "        self.a, self.b = nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8)\n\n"
                 "    def forward(self, x):\n"
                 "        return self.b(self.a(x.to(self.a.weight.dtype)).to(self.b.weight.dtype))\n\n"
                 "    def example_inputs(self, batch):\n"
                 "        return (torch.randn(batch, 8),)\n")
    r = _invoke(f"{f}:Mixed", "--mesh", "fsdp=2")
    assert r.exit_code == 2 and "the root holds bfloat16, float32: give --dtype" in r.stderr, r.stderr
    assert _invoke(f"{f}:Mixed", "--mesh", "fsdp=2", "--dtype", "bf16").exit_code == 0


def test_six_n_d_counts_the_whole_model_under_a_mesh():
    """A rank holds a shard of the parameters but works on the whole model for its batch (FSDP2
    shards storage, not work; a tp group shares one batch's work): the 6·N·D line of fsdp=2,tp=2
    is the single-device one, N and exact FLOPs alike (the oracle: a profile with no mesh, whose
    per-rank batch is the same). It once divided N by the 4 ranks and doubled the ratio."""
    single = _invoke(LLAMA, "--batch", "2")
    mesh = _invoke(LLAMA, "--batch", "2", "--mesh", "fsdp=2,tp=2", "--parallelize", PAR)
    line = next(x for x in single.stdout.splitlines() if x.startswith("6·N·D"))
    got = next(x for x in mesh.stdout.splitlines() if x.startswith("6·N·D"))
    want = line.replace("exact matmul+attention", "exact matmul+attention of a tp group (rank's × 2)")
    assert got == want, (got, line)


def test_six_n_d_counts_the_whole_models_frozen_parameters_under_a_mesh(tmp_path):
    """A frozen embedding (200 × 32 = 6,400 parameters): the 6·N·D line under fsdp=2 names the whole
    model's frozen count, as without a mesh (the oracle), not rank 0's shard of it (3,200)."""
    f = tmp_path / "frozen.py"
    f.write_text("import torch\nfrom torch import nn\n"
                 "class Frozen(nn.Module):\n"
                 "    def __init__(self):\n"
                 "        super().__init__()\n"
                 "        self.emb = nn.Embedding(200, 32); self.emb.weight.requires_grad_(False)\n"
                 "        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])\n"
                 "        self.head = nn.Linear(32, 10)\n"
                 "    def forward(self, x):\n"
                 "        h = self.emb(x)\n"
                 "        for b in self.blocks:\n"
                 "            h = b(h)\n"
                 "        return self.head(h.mean(1))\n"
                 "    @staticmethod\n"
                 "    def example_inputs(batch):\n"
                 "        return (torch.randint(0, 200, (batch, 16)),)\n")
    single = _invoke(f"{f}:Frozen", "--batch", "2")
    mesh = _invoke(f"{f}:Frozen", "--batch", "2", "--mesh", "fsdp=2")
    line = next(x for x in single.stdout.splitlines() if x.startswith("6·N·D"))
    assert "6,400 of them frozen" in line, line
    assert next(x for x in mesh.stdout.splitlines() if x.startswith("6·N·D")) == line


def test_a_ranks_peak_is_fitted_on_the_gpu_under_a_mesh():
    """--gpu under --mesh: the fit line and memory.fit hold the rank's peak reserved by the caching
    allocator plus the fixed costs (under pp the largest of the ranks' whole steps so replayed, each
    in pipeline.stages) against the capacity a single-device profile reports for the same GPU; no
    largest batch (the planner searches the global one). They were absent."""
    single = json.loads(_invoke(LLAMA, "--batch", "2", "--gpu", "h100", "--format", "json").stdout)
    capacity = single["memory"]["fit"]["capacity_bytes"]
    for mesh in (["--mesh", "fsdp=2"], ["--mesh", "pp=2", "--microbatches", "4"]):
        r = _invoke(LLAMA, "--batch", "2", *mesh, "--gpu", "h100", "--format", "json")
        assert r.exit_code == 0, r.stderr
        doc = json.loads(r.stdout)
        peak = doc["memory"]["reserved"]["fit_bytes"]
        if "pipeline" in doc:
            assert peak == max(s["fit_bytes"] for s in doc["pipeline"]["stages"])
            assert all(s["fit_bytes"] > s["peak_bytes"] + 400 * 2**20 for s in doc["pipeline"]["stages"])
        fit = doc["memory"]["fit"]
        assert fit["basis"] == ("peak_reserved_bytes + fixed (the largest rank's step)" if "pipeline" in doc
                                else "peak_reserved_bytes + fixed"), fit
        assert (fit["capacity_bytes"], fit["peak_bytes"], fit["max_batch"]) == (capacity, peak, None), fit
        assert fit["headroom_bytes"] == capacity - peak
    text = _invoke(LLAMA, "--batch", "2", "--mesh", "fsdp=2", "--gpu", "h100").stdout
    assert any(line.split()[:2] == ["fit", "fits,"] for line in text.splitlines()), text


def test_hugging_face_attention_under_tp_warns_of_the_general_path():
    """Under tp transformers' attention takes its general path (docs/limits.md): the peak is an
    upper bound for an unpadded batch, and the report says so; not under fsdp alone (eager path,
    exact), nor with an attention_mask given (eager takes the general path too)."""
    pytest.importorskip("transformers")
    qwen = str(ROOT / "tests/models/hf_tp_models.py") + ":qwen3"
    mask = ["--input", "input_ids=long[B,16]<256", "--input", "attention_mask=long[B,16]<2"]

    def warned(*args):
        r = _invoke(qwen, "--batch", "2", *args, "--format", "json")
        assert r.exit_code == 0, r.stderr
        return any("its general path" in w for w in json.loads(r.stdout)["warnings"])

    assert warned("--mesh", "tp=2")
    assert not warned("--mesh", "fsdp=2") and not warned("--mesh", "tp=2", *mask)


def test_checkpoint_under_a_mesh_says_the_what_if_is_single_device():
    """The what-if table is computed on one device only; under --mesh it was dropped silently."""
    r = _invoke(LLAMA, "--batch", "2", "--mesh", "fsdp=2", "--checkpoint", "layers.*", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["checkpoint"] is None
    assert any("the what-if table" in w and "run without --mesh" in w for w in doc["warnings"]), doc["warnings"]


def test_compile_under_a_mesh_says_the_what_if_is_single_device():
    """The compile what-if (the step eager beside compiled) is one device's too: under --mesh the
    JSON's compile was null with no word of why, where --checkpoint's said so. One device keeps it."""
    args = ("--batch", "2", "--compile-blocks", "layers.*", "--format", "json")
    r = _invoke(LLAMA, *args, "--mesh", "fsdp=2")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["compile"] is None
    said = [w for w in doc["warnings"] if w.startswith("--compile-blocks with --mesh")]
    assert len(said) == 1 and "run without --mesh to see it" in said[0], doc["warnings"]
    one = json.loads(_invoke(LLAMA, *args).stdout)
    assert one["compile"]["regions"] and not any("with --mesh" in w for w in one["warnings"])


STACK = """import torch, torch.nn as nn
class Stack(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
        self.act = nn.ReLU(inplace=inplace)
    def forward(self, x):
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x
    @staticmethod
    def example_inputs(b):
        return (torch.randn(b, 16, 64),)
def inplace():
    return Stack(inplace=True)
"""


@pytest.mark.parametrize("name,warned", [("Stack", False), ("inplace", True)])
def test_a_block_output_changed_in_place_under_fsdp_is_flagged(tmp_path, name, warned):
    """ReLU(inplace=True) on each block's output (a view FSDP2 returns) drops FSDP2's pre-backward
    hook: the backward gathers none of the 3 blocks (eager PyTorch fails the step, "setStorage ...
    storage of size 0"); out of place, each block is gathered again in backward."""
    path = tmp_path / "stack.py"
    path.write_text(STACK)
    r = _invoke(f"{path}:{name}", "--batch", "2", "--mesh", "fsdp=2", "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    backward = sum(c["count"] for c in doc["collectives"] if c["op"] == "all_gather" and c["phase"] == "backward")
    assert backward == (0 if warned else 3)
    flagged = [w for w in doc["warnings"] if w.startswith("FSDP2 gathered 3 blocks in forward but only 0")]
    assert bool(flagged) == warned, doc["warnings"]


def test_a_block_gathered_again_while_the_root_runs_is_not_flagged():
    """Gemma2 ends in a final logit softcap, root-level ops: the backward prefetches the last
    block's parameters while they run, so that gather belongs to the root's row. It was read as a
    block never gathered again ("FSDP2 gathered 2 blocks in forward but only 1"), a false alarm:
    the real gloo run succeeds with the predicted peak."""
    pytest.importorskip("transformers")
    r = _invoke(str(ROOT / "tests/models/hf_tp_models.py") + ":gemma2", "--batch", "2", "--mesh", "fsdp=2",
                "--format", "json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    gathers = [(c["phase"], c["module"], c["count"]) for c in doc["collectives"] if c["op"] == "all_gather"]
    assert ("backward", "", 1) in gathers and sum(n for phase, _, n in gathers if phase == "backward") == 2
    assert not [w for w in doc["warnings"] if w.startswith("FSDP2 gathered")], doc["warnings"]


def test_markdown_under_a_mesh_says_whose_figures_and_lists_the_collectives():
    """The markdown report said nothing of the mesh: a rank's 34,976 parameters read as the model's."""
    r = _invoke(LLAMA, "--batch", "2", "--mesh", "fsdp=2,tp=2", "--parallelize", PAR, "--format", "markdown")
    assert r.exit_code == 0, r.stderr
    assert "#### Mesh `fsdp=2,tp=2`" in r.stdout and "figures are rank 0's" in r.stdout
    doc = json.loads(_invoke(LLAMA, "--batch", "2", "--mesh", "fsdp=2,tp=2", "--parallelize", PAR,
                             "--format", "json").stdout)
    total = sum(c["count"] for c in doc["collectives"])
    row = next(line for line in r.stdout.splitlines() if line.startswith("total "))
    assert row.split()[1] == f"{total:,}", (row, total)


def test_gpu_under_a_mesh_says_no_largest_batch_is_searched():
    """One device with --gpu searches the largest batch; under --mesh none is searched (a plan's
    job), which was silent: the fit line simply had no largest batch, and --no-max-batch was
    accepted as if it changed something. Now a warning names fxacct plan; --no-max-batch silences it."""
    one = _invoke(LLAMA, "--gpu", "h100", "--format", "json")
    assert one.exit_code == 0 and json.loads(one.stdout)["memory"]["fit"]["max_batch"] > 0
    mesh = _invoke(LLAMA, "--mesh", "fsdp=2", "--gpu", "h100", "--format", "json")
    doc = json.loads(mesh.stdout)
    assert doc["memory"]["fit"]["max_batch"] is None
    assert any(w.startswith("no largest batch under --mesh") and "fxacct plan" in w for w in doc["warnings"])
    quiet = json.loads(_invoke(LLAMA, "--mesh", "fsdp=2", "--gpu", "h100", "--no-max-batch", "--format", "json").stdout)
    assert not any(w.startswith("no largest batch") for w in quiet["warnings"])


def test_interconnect_without_gpu_says_it_changes_nothing_under_a_mesh_too():
    """On one device --interconnect was said to change nothing; under --mesh without --gpu it was
    silently accepted (no communication is timed without a GPU's links)."""
    doc = json.loads(_invoke(LLAMA, "--mesh", "fsdp=2", "--interconnect", "roce", "--format", "json").stdout)
    assert any(w.startswith("--interconnect roce has no effect without --gpu") for w in doc["warnings"])
    timed = json.loads(_invoke(LLAMA, "--mesh", "fsdp=2", "--interconnect", "roce", "--gpu", "h100",
                               "--no-max-batch", "--format", "json").stdout)
    assert not any(w.startswith("--interconnect") for w in timed["warnings"])

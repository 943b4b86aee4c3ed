"""`fxacct check` and `fxacct diff`: exit 0 when every budget holds, 1 with a table of the budgets
that fail, 2 for usage errors, 3 when the model fails, so CI tells "over budget" from "broken".
Expected figures are computed in the comments for the small MLP example (d_model 64, d_hidden 128,
2 blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import target

from fxacct.load.profile_file import READS
from fxacct.report.document import SCHEMA
from fxacct_cli.main import cli

MLP = [target("examples/mlp.py:MLP"), "-k", "d_model=64", "-k", "d_hidden=128", "-k", "n_blocks=2"]
# per block: ln 2·64 = 128, fc1 64·128 + 128 = 8,320, fc2 128·64 + 64 = 8,256 → 16,704;
# 2 blocks + ln_f 128 → 33,536 parameters
MLP_PARAMS = 2 * (128 + 8_320 + 8_256) + 128
H100_REPORTED = 81_559 * 2**20  # bytes: nvidia-smi memory.total of an H100 80GB HBM3 (81559 MiB)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def shown(result) -> str:
    return f"exit code {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def exits(code: int, *args: str):
    result = invoke(*args)
    assert result.exit_code == code, shown(result)
    if code in (2, 3):
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), shown(result)
    assert "\x1b[" not in result.stdout + result.stderr, "no colour codes in a CI log"
    return result


# --------------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------------

def test_check_fails_a_1kb_memory_budget():
    # the MLP's parameters alone are 33,536 · 4 B = 134,144 B > 1 KB = 1,000 B
    out = exits(1, "check", *MLP, "--max-memory", "1KB").stdout
    row = next(line for line in out.splitlines() if line.startswith("memory"))
    assert "1,000 B" in row and "OVER" in row, out
    assert "FAILED: 1 of 1 budget(s) over (memory)" in out, out


def test_check_passes_an_80gb_memory_budget():
    out = exits(0, "check", *MLP, "--max-memory", "80GB").stdout
    assert "ok: all 1 budget(s) hold" in out and "OVER" not in out, out


def test_check_json_lists_every_budget_with_its_verdict():
    doc = json.loads(exits(1, "check", *MLP, "--batch", "2", "--max-memory", "1KB", "--max-params", "1e6",
                           "--max-flops-per-example", "1e3", "--format", "json").stdout)
    assert doc["schema"] == "fxacct.check/1" and doc["ok"] is False, doc
    budgets = {b["name"]: b for b in doc["budgets"]}
    assert list(budgets) == ["memory", "params", "flops_per_example"], doc
    assert (budgets["memory"]["limit"], budgets["memory"]["ok"]) == (1_000, False), doc
    assert budgets["memory"]["value"] == doc["totals"]["peak_train_bytes"], doc
    assert budgets["params"] == {**budgets["params"], "value": MLP_PARAMS, "limit": 10**6, "ok": True}, doc
    assert budgets["params"]["over"] == MLP_PARAMS - 10**6, doc
    # per example = (forward + backward) / batch; the matmuls alone: 2 blocks · 2 mm · 2·64·128 = 65,536
    # forward per example, twice that backward (dW and dX), far over 1,000
    t = doc["totals"]
    assert budgets["flops_per_example"]["value"] == (t["forward_flops"] + t["backward_flops"]) // 2, doc
    assert t["forward_flops_by_class"]["matmul"] == 2 * 65_536, doc
    assert budgets["flops_per_example"]["ok"] is False, doc


def test_check_defaults_the_memory_budget_to_the_gpu_as_the_driver_reports_it():
    # the example, on the small MLP: every budget holds on 8 H100s with ZeRO-2
    doc = json.loads(exits(0, "check", *MLP, "--batch", "32", "--amp", "bf16", "--optimizer", "adamw", "--gpu",
                           "h100", "--world-size", "8", "--shard", "zero2", "--format", "json").stdout)
    memory = doc["budgets"][0]
    assert (memory["name"], memory["limit"], memory["ok"]) == ("memory", H100_REPORTED, True), doc
    assert "zero2 over 8" in memory["figure"], doc
    # the 8 ranks reduce over one process group: NCCL's buffers (8 MiB) beside the CUDA context (400
    # MiB), as --mesh dp=8 counts them (they were left out)
    prof = json.loads(exits(0, "profile", *MLP, "--batch", "32", "--amp", "bf16", "--gpu", "h100", "--world-size", "8",
                            "--shard", "zero2", "--no-max-batch", "--format", "json").stdout)
    assert prof["memory"]["reserved"]["fixed_outside_bytes"] == (400 + 8) * 2**20
    assert memory["value"] == prof["memory"]["reserved"]["fit_bytes"], (memory, prof["memory"]["reserved"])


def test_check_memory_on_a_gpu_budgets_reserved_plus_the_fixed_costs():
    """With --gpu the memory budget holds the step's peak reserved by the CUDA caching allocator plus
    the fixed costs outside it (the CUDA context, 400 MiB: fxacct.memory.fixed), not the op-level
    peak: the small MLP's op-level peak is under 2 MB, yet 100 MB is over budget on an H100, while
    without --gpu the same budget holds."""
    prof = json.loads(exits(0, "profile", *MLP, "--gpu", "h100", "--no-max-batch", "--format", "json").stdout)
    reserved = prof["totals"]["peak_reserved_bytes"]
    assert prof["totals"]["peak_train_bytes"] < 2 * 10**6 < 100 * 10**6 < reserved + 400 * 2**20
    doc = json.loads(exits(1, "check", *MLP, "--gpu", "h100", "--max-memory", "100MB", "--format", "json").stdout)
    memory = doc["budgets"][0]
    assert (memory["name"], memory["limit"], memory["ok"]) == ("memory", 100 * 10**6, False), doc
    assert memory["value"] == reserved + 400 * 2**20, doc
    assert memory["figure"].startswith("peak_reserved_bytes + fixed"), doc
    # the totals check carries are the profile's, the predicted step time too (it was null in check)
    assert prof["totals"]["predicted_step_ms"] is not None
    assert doc["totals"] == prof["totals"], (doc["totals"], prof["totals"])
    exits(0, "check", *MLP, "--max-memory", "100MB")


def test_check_step_time_at_an_assumed_mfu():
    # model FLOPs (batch 1, fp32 matmuls: 67e12 FLOP/s on an H100) at MFU 0.5:
    # (65,536 forward + 131,072 backward matmul FLOPs) / (67e12 · 0.5) = 5.87e-9 s, far under 1 ms
    doc = json.loads(exits(0, "check", *MLP, "--gpu", "h100", "--max-memory", "80GB", "--max-step-time", "1ms",
                           "--mfu", "0.5", "--format", "json").stdout)
    step = next(b for b in doc["budgets"] if b["name"] == "step_time")
    assert step["value"] == pytest.approx((65_536 + 131_072) / (67e12 * 0.5)), doc
    assert step["limit"] == pytest.approx(1e-3) and doc["assumptions"]["mfu"] == 0.5, doc


def test_check_writes_its_output_and_still_sets_the_exit_code(tmp_path):
    path = tmp_path / "check.json"
    exits(1, "check", *MLP, "--max-memory", "1KB", "--format", "json", "-o", str(path))
    assert json.loads(path.read_text())["ok"] is False


@pytest.mark.parametrize("args, says", [
    ([], "no budget"),
    (["--max-memory", "80XB"], "--max-memory"),
    (["--max-memory", "0GB"], "--max-memory"),
    (["--max-params", "many"], "--max-params"),
    (["--max-step-time", "1ms"], "--gpu"),
    (["--max-step-time", "soon", "--gpu", "h100"], "--max-step-time"),
    (["--gpu", "h100", "--mfu", "0"], "--mfu"),
    (["--gpu", "h100", "--mfu", "1.5"], "--mfu"),
])
def test_check_usage_errors_exit_2(args, says):
    line = exits(2, "check", *MLP, *args).stderr
    assert says in line, line


def test_check_a_broken_model_exits_3():
    exits(3, "check", target("tests/models/forward_raises.py:ForwardRaises"), "--max-memory", "80GB")


# --------------------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict[str, Path]:
    """baseline: d_hidden 128; wider: d_hidden 160 (every matmul FLOP × 160/128 = 1.25)."""
    folder = tmp_path_factory.mktemp("diff")
    out = {}
    for name, hidden in (("baseline", 128), ("wider", 160)):
        path = folder / f"{name}.json"
        result = CliRunner().invoke(cli, ["profile", target("examples/mlp.py:MLP"), "-k", "d_model=64",
                                          "-k", f"d_hidden={hidden}", "-k", "n_blocks=2", "--format", "json",
                                          "-o", str(path)], catch_exceptions=False)
        assert result.exit_code == 0, shown(result)
        out[name] = path
    return out


def test_diff_fails_when_flops_grow_beyond_the_allowed_percent(profiles):
    # matmul FLOPs scale with d_hidden: 25% more; the other FLOPs (layer norms, GELU, adds) grow less,
    # so forward+backward grows between 5% and 25%
    out = exits(1, "diff", str(profiles["baseline"]), str(profiles["wider"]), "--max-increase", "flops=5%").stdout
    row = next(line for line in out.splitlines() if line.startswith("flops ") and "OVER" in line)
    assert "+5%" in row, out
    assert "FAILED: 1 of 1 budget(s) over (flops)" in out, out
    assert "modules that changed most" in out and "blocks.0.fc1" in out, out


def test_diff_passes_within_the_allowed_percent(profiles):
    exits(0, "diff", str(profiles["baseline"]), str(profiles["wider"]), "--max-increase", "flops=30%",
          "--max-increase", "peak_train_bytes=30%")
    exits(0, "diff", str(profiles["baseline"]), str(profiles["baseline"]), "--max-increase", "flops=0%")


def test_diff_json_has_exact_changes(profiles):
    old, new = (json.loads(profiles[k].read_text())["totals"] for k in ("baseline", "wider"))
    doc = json.loads(exits(1, "diff", str(profiles["baseline"]), str(profiles["wider"]), "--max-increase",
                           "flops=5%", "--max-increase", "forward_flops_by_class.matmul=25%",
                           "--format", "json").stdout)
    totals = {c["key"]: c for c in doc["totals"]}
    flops_old = old["forward_flops"] + old["backward_flops"]
    flops_new = new["forward_flops"] + new["backward_flops"]
    assert (totals["flops"]["old"], totals["flops"]["new"]) == (flops_old, flops_new), doc
    assert totals["flops"]["change"] == flops_new - flops_old, doc
    # forward matmul: 2 blocks · 2 mm · 2·64·h per example: 65,536 → 81,920, exactly +25% (allowed 25%: ok)
    assert (totals["forward_flops_by_class.matmul"]["old"], totals["forward_flops_by_class.matmul"]["new"]) == (
        65_536, 81_920), doc
    verdicts = {b["key"]: b["ok"] for b in doc["budgets"]}
    assert verdicts == {"flops": False, "forward_flops_by_class.matmul": True}, doc
    assert doc["ok"] is False


def test_diff_of_different_schema_versions_is_a_usage_error(profiles, tmp_path):
    doc = json.loads(profiles["wider"].read_text())
    doc["schema"] = "fxacct.profile/2"
    other = tmp_path / "v2.json"
    other.write_text(json.dumps(doc))
    line = exits(2, "diff", str(profiles["baseline"]), str(other)).stderr
    assert "fxacct.profile/1" in line and "fxacct.profile/2" in line, line
    # two files of a version this fxacct does not read were compared silently
    line = exits(2, "diff", str(other), str(other)).stderr
    assert "has schema fxacct.profile/2, which this fxacct does not read (it reads fxacct.profile/1)" in line, line
    assert SCHEMA in READS
    line = exits(2, "diff", str(profiles["baseline"]), str(tmp_path)).stderr  # it said "no such file"
    assert f"{tmp_path} is a directory" in line, line


def test_diff_budget_on_a_total_that_is_not_a_number(profiles, tmp_path):
    """A total a file holds as a string: said as such (it read "null ... profile with the flags that
    compute it")."""
    doc = json.loads(profiles["wider"].read_text())
    doc["totals"]["params"] = "many"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    line = exits(2, "diff", str(profiles["baseline"]), str(edited), "--max-increase", "params=5%").stderr
    assert "totals.params is 'many' in the new profile, not a number" in line, line


def test_diff_top_0_says_how_many_modules_changed(profiles):
    """--top 0 shows no module; it said none had changed."""
    for fmt in ("table", "markdown"):
        out = exits(0, "diff", str(profiles["baseline"]), str(profiles["wider"]), "--top", "0", "--format", fmt).stdout
        assert "module(s) changed their FLOPs or activations (--top 0 shows none)" in out, out
        assert "no module changed" not in out.lower(), out


@pytest.mark.parametrize("content, says", [
    ("not json {", "is not JSON"),
    ('{"totals": {}}', "not an fxacct profile"),
    ("[1, 2]", "not an fxacct profile"),
])
def test_diff_of_a_file_that_is_not_a_profile_is_a_usage_error(profiles, tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    line = exits(2, "diff", str(profiles["baseline"]), str(bad)).stderr
    assert says in line and "bad.json" in line, line


@pytest.mark.parametrize("budget, says", [
    ("flopz=5%", "unknown --max-increase key 'flopz'"),
    ("flops", "KEY=PCT"),
    ("flops=-5%", "negative"),
    ("flops=five", "not a percentage"),
    ("predicted_step_ms=5%", "null"),
])
def test_diff_bad_budgets_are_usage_errors(profiles, budget, says):
    line = exits(2, "diff", str(profiles["baseline"]), str(profiles["wider"]), "--max-increase", budget).stderr
    assert says in line, line


def test_diff_of_a_missing_file_is_a_usage_error(profiles, tmp_path):
    line = exits(2, "diff", str(profiles["baseline"]), str(tmp_path / "missing.json")).stderr
    assert "missing.json" in line, line


def test_diff_budgets_the_pipeline_ranks_peak_and_names_differing_steps(tmp_path):
    """Under pp the totals are stage 0's micro-batch, unchanged by M; pipeline_peak_bytes is the
    largest rank's step peak, which 1F1B's in-flight micro-batches raise from M = 2 to M = 4 (on
    the last stage: its outputs are kept to the step's end). A baseline without the mesh is
    flagged as another step."""
    gpt = [target("examples/gpt2.py:GPT"), "-k", "n_layer=2", "-k", "n_embd=64", "-k", "n_head=4", "-k",
           "vocab_size=1001", "-k", "block_size=32", "--batch", "2", "--format", "json"]
    paths = {}
    for name, extra in (("m2", ["--mesh", "pp=2", "--microbatches", "2"]),
                        ("m4", ["--mesh", "pp=2", "--microbatches", "4"]), ("single", [])):
        paths[name] = tmp_path / f"{name}.json"
        exits(0, "profile", *gpt, *extra, "-o", str(paths[name]))
    docs = {k: json.loads(p.read_text()) for k, p in paths.items()}
    peaks = {k: max(s["peak_bytes"] for s in docs[k]["pipeline"]["stages"]) for k in ("m2", "m4")}
    assert peaks["m4"] > peaks["m2"]
    assert docs["m4"]["totals"]["peak_train_bytes"] == docs["m2"]["totals"]["peak_train_bytes"]
    doc = json.loads(exits(1, "diff", str(paths["m2"]), str(paths["m4"]), "--max-increase",
                           "pipeline_peak_bytes=1%", "--format", "json").stdout)
    assert [(b["key"], b["old"], b["new"], b["ok"]) for b in doc["budgets"]] == \
        [("pipeline_peak_bytes", peaks["m2"], peaks["m4"], False)]
    assert doc["config_changes"] == []
    out = exits(0, "diff", str(paths["single"]), str(paths["m2"])).stdout
    assert "note: the two profiles are of different steps (mesh none -> pp=2; world_size 1 -> 2)" in out, out


@pytest.mark.slow  # test_diff_budgets_the_pipeline_ranks_peak_and_names_differing_steps keeps a mesh budget fast
def test_check_under_a_mesh_budgets_a_ranks_memory_and_the_models_parameters():
    """--mesh: the memory budget is the rank's peak (under pp the largest rank's over the step, not
    stage 0's micro-batch), the params budget the model's (not the rank's shards: the single-device
    count); FLOP and step-time budgets, a rank's share, are refused before any trace."""
    llama = [target("examples/llama.py:Llama"), "--batch", "2"]
    single = json.loads(exits(0, "profile", *llama, "--format", "json").stdout)
    for mesh in (["--mesh", "fsdp=2"], ["--mesh", "pp=2", "--microbatches", "4"]):
        pipeline = mesh[1].startswith("pp")
        prof = json.loads(exits(0, "profile", *llama, *mesh, "--format", "json").stdout)
        params = [] if pipeline else ["--max-params", "1e9"]
        doc = json.loads(exits(1, "check", *llama, *mesh, "--max-memory", "1KB", *params, "--format", "json").stdout)
        budgets = {b["name"]: b for b in doc["budgets"]}
        expected = max(s["peak_bytes"] for s in prof["pipeline"]["stages"]) if pipeline \
            else prof["totals"]["peak_train_bytes"]
        assert (budgets["memory"]["value"], budgets["memory"]["ok"]) == (expected, False), (mesh, doc)
        if not pipeline:
            assert budgets["params"]["value"] == single["totals"]["params"] > prof["totals"]["params"], doc
    # under fsdp a rank runs the whole model on its own batch: its FLOPs per example are the model's
    per_example = single["totals"]["forward_flops"] + single["totals"]["backward_flops"]
    doc = json.loads(exits(0, "check", *llama, "--mesh", "fsdp=2", "--max-flops-per-example", "1e12",
                           "--format", "json").stdout)
    assert [b["value"] * 2 for b in doc["budgets"] if b["name"] == "flops_per_example"] == [per_example], doc
    tp = ["--mesh", "fsdp=2,tp=2", "--parallelize", target("examples/llama.py:parallelize")]
    assert "its tensor-parallel group's" in exits(2, "check", *llama, *tp, "--max-flops", "1e9").stderr
    assert "--max-params with --mesh pp=2" in exits(2, "check", *llama, "--mesh", "pp=2", "--max-params", "1e9").stderr

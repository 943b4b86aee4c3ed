"""`fxacct estimate`: the seeds' back-of-envelope numbers (CS336 lecture 2, shared/seeds/000_*),
reproduced through the CLI, with every expected value computed in a comment; and every bad input
is one `error:` line with exit code 2.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

from fxacct_cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
H100_BF16 = 989.5e12  # FLOP/s, NVIDIA H100 SXM datasheet, dense (the seeds' h100_flop_per_sec)
H100_FP32 = 67e12  # FLOP/s, NVIDIA H100 SXM datasheet, FP32 (no tensor cores)
H100_NOMINAL = 80 * 10**9  # bytes, "80GB" as the seeds use it (h100_bytes = 80e9)
SEEDS_TRAIN = ["--params", "70e9", "--tokens", "15e12", "--world-size", "1024", "--gpu", "h100", "--mfu", "0.3"]
SEEDS_MAX = ["--world-size", "8", "--gpu", "h100", "--optimizer", "adamw", "--dtype", "fp32"]


def invoke(*args: str):
    return CliRunner().invoke(cli, ["estimate", *args], catch_exceptions=False)


def shown(result) -> str:
    return f"exit code {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def ok(*args: str) -> str:
    result = invoke(*args)
    assert result.exit_code == 0, shown(result)
    return result.stdout


def as_json(*args: str) -> dict:
    return json.loads(ok(*args, "--format", "json"))


def usage_error(*args: str) -> str:
    """Exit 2, one `error:` line on stderr, no traceback; returns the line."""
    result = invoke(*args)
    assert result.exit_code == 2, shown(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown(result)
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


# --------------------------------------------------------------------------------------------------
# train-time
# --------------------------------------------------------------------------------------------------

def test_train_time_reproduces_the_seeds_70b_on_1024_h100s():
    # total = 6·N·D = 6 · 70e9 · 15e12 = 6.3e24 FLOPs
    # per day = 989.5e12 · 0.3 · 1024 · 86,400 = 2.6263e22 FLOPs
    # days = 6.3e24 / 2.6263e22 = 239.9 → "240"; months = 239.9 / 30 = 7.996 → "8.0"
    out = ok("train-time", *SEEDS_TRAIN)
    assert "6.30e24" in out and "2.63e22" in out, out
    assert "\n8 months (240 days) on 1,024 × NVIDIA H100 SXM5 80GB" in out, out  # the unit by magnitude
    assert "989.5 TFLOP/s" in out, out


def test_train_time_line_picks_a_human_unit():
    # 6·N·D = 6 · 1e9 · 1e8 = 6e17 FLOPs; per day 989.5e12 · 0.3 · 1 · 86,400 = 2.564784e19 FLOPs
    # → 0.023394 days = 33.69 min (not "0.0234 days ≈ 0.00078 months")
    out = ok("train-time", "--params", "1e9", "--tokens", "1e8", "--world-size", "1", "--gpu", "h100", "--mfu", "0.3")
    minutes = 6e17 / (989.5e12 * 0.3 * 86_400) * 24 * 60
    assert f"{minutes:.3g}" == "33.7"
    assert "\n33.7 min (0.0234 days) on 1 × NVIDIA H100 SXM5 80GB at MFU 0.3" in out, out
    row = next(line for line in out.splitlines() if line.startswith("time to train"))
    assert row.split()[3:5] == ["33.7", "min"], row
    assert "0.00078" not in out, out


def test_train_time_json_is_exact():
    doc = as_json("train-time", *SEEDS_TRAIN)
    assert doc["total_flops"] == 6 * 70 * 10**9 * 15 * 10**12 == 6_300_000_000_000_000_000_000_000, doc
    per_day = H100_BF16 * 0.3 * 1024 * 86_400
    assert doc["flops_per_day"] == pytest.approx(per_day, rel=1e-12), doc
    assert doc["days"] == pytest.approx(6.3e24 / per_day, rel=1e-12), doc
    assert round(doc["days"]) == 240 and round(doc["months"], 1) == 8.0, doc
    assert doc["peak_flops_per_s"] == H100_BF16 and doc["peak_dtype"] == "bfloat16", doc


def test_gpus_is_an_alias_of_world_size():
    aliased = [a if a != "--world-size" else "--gpus" for a in SEEDS_TRAIN]
    assert ok("train-time", *aliased) == ok("train-time", *SEEDS_TRAIN)
    assert as_json("max-params", "--gpus", "8", "--shard", "zero3", "--gpu", "h100")["max_params"] == 40 * 10**9
    # one setting under two names: two different values are refused (click would keep the last)
    both = CliRunner().invoke(cli, ["estimate", "train-time", *SEEDS_TRAIN, "--gpus", "16"])
    assert both.exit_code == 2 and "given as 1024 and 16; give one value" in both.output
    assert len(both.output.strip().splitlines()) == 1
    assert ok("train-time", *SEEDS_TRAIN, "--gpus", "1024") == ok("train-time", *SEEDS_TRAIN)  # the same value twice


def test_train_time_dtype_picks_the_peak():
    # fp8 on an H100: 1979 TFLOP/s dense, twice bf16, so half the days
    bf16 = as_json("train-time", *SEEDS_TRAIN)
    fp8 = as_json("train-time", *SEEDS_TRAIN, "--dtype", "fp8")
    assert fp8["peak_flops_per_s"] == 1979e12, fp8
    assert fp8["days"] == pytest.approx(bf16["days"] * 989.5 / 1979), fp8


@pytest.fixture(scope="module")
def gpt_profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("estimate") / "gpt.json"
    result = CliRunner().invoke(cli, ["profile", str(ROOT / "examples/gpt2.py") + ":GPT", "-k", "n_layer=1",
                                      "-k", "n_embd=32", "-k", "n_head=2", "-k", "block_size=16",
                                      "-k", "vocab_size=64", "--batch", "2", "--format", "json", "-o", str(path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, shown(result)
    return path


def test_train_time_from_a_profile_uses_its_flops_per_token(gpt_profile):
    prof = json.loads(gpt_profile.read_text())
    t, c = prof["totals"], prof["config"]
    # per token = (forward + backward) (matmul + attention) / (batch · T), T = 16 here
    model_flops = sum(t[f"{p}_flops_by_class"][k] for p in ("forward", "backward") for k in ("matmul", "attention"))
    assert c["batch"] == 2 and c["tokens_per_example"] == 16, c
    per_token = Fraction(model_flops, 2 * 16)
    doc = as_json("train-time", "--from", str(gpt_profile), "--tokens", "1e12", "--world-size", "64", "--gpu",
                  "h100", "--mfu", "0.4")
    assert doc["flops_source"] == "profile", doc
    assert Fraction(doc["total_flops"]) == per_token * 10**12, doc
    # days = total / (67e12 · 0.4 · 64 · 86,400)   (the profile has no --amp/--dtype: the fp32 peak,
    # as `fxacct check` uses for the same profile)
    assert doc["peak_dtype"] == "float32" and doc["peak_flops_per_s"] == H100_FP32, doc
    assert doc["days"] == pytest.approx(float(per_token * 10**12) / (H100_FP32 * 0.4 * 64 * 86_400)), doc
    # beside it, 6·N·D with the profile's own N
    assert doc["six_n_d_flops"] == 6 * t["params"] * 10**12, doc
    out = ok("train-time", "--from", str(gpt_profile), "--tokens", "1e12", "--gpus", "64", "--gpu", "h100")
    assert "FLOPs per token" in out and "6·N·D with the profile's N" in out, out


TINY_GPT = [str(ROOT / "examples/gpt2.py") + ":GPT", "-k", "n_layer=1", "-k", "n_embd=32", "-k", "n_head=2",
            "-k", "block_size=16", "-k", "vocab_size=64", "--batch", "2"]


@pytest.mark.parametrize("precision, expected", [((), "float32"), (("--dtype", "bf16"), "bfloat16"),
                                                 (("--amp", "fp16"), "float16")])
def test_train_time_from_a_profile_uses_the_peak_check_uses(tmp_path, precision, expected):
    # The same model and flags: `check --max-step-time` and `estimate train-time --from` its profile
    # price the step at the same matmul peak (--amp, else --dtype, else float32), and say why.
    path = tmp_path / "p.json"
    result = CliRunner().invoke(cli, ["profile", *TINY_GPT, *precision, "--format", "json", "-o", str(path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, shown(result)
    result = CliRunner().invoke(cli, ["check", *TINY_GPT, *precision, "--gpu", "h100", "--max-step-time", "1h",
                                      "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, shown(result)
    checked = json.loads(result.stdout)["assumptions"]
    doc = as_json("train-time", "--from", str(path), "--tokens", "1e9", "--gpu", "h100")
    assert doc["peak_dtype"] == checked["peak_dtype"] == expected, (doc, checked)
    assert doc["peak_flops_per_s"] == checked["peak_flops_per_s"], (doc, checked)
    out = ok("train-time", "--from", str(path), "--tokens", "1e9", "--gpu", "h100")
    why = "the profile (no --amp or --dtype: float32" if not precision else f"the profile's {precision[0]}"
    assert f"{expected}, dense; dtype from {why}" in out, out


def test_train_time_without_tokens_names_the_flag_and_a_value():
    # it said "--tokens None is not a count", the flag's missing value printed as Python's None
    line = usage_error("train-time", "--params", "70e9", "--gpu", "h100")
    assert "--tokens is missing" in line and "15e12" in line and "None" not in line, line


@pytest.mark.parametrize("dtype", ["int8", "bool", "complex64"])
def test_a_dtype_without_a_datasheet_peak_is_a_usage_error(dtype):
    # it took the float32 peak silently ("GPU peak 67 TFLOP/s ..., int8, dense")
    line = usage_error("train-time", "--params", "7e9", "--tokens", "1e12", "--gpu", "h100", "--dtype", dtype)
    assert f"--dtype {dtype}: fxacct knows" in line and "bfloat16, float16, float8 only" in line, line


def test_numbers_beyond_a_float_are_usage_errors(gpt_profile):
    """1e400 overflowed a float inside the estimate (an internal error, exit 4); 1e30 is the largest
    a flag takes, and three such numbers multiplied stay in a float's range."""
    line = usage_error("train-time", "--params", "1e400", "--tokens", "1e12", "--gpu", "h100")
    assert line == "error: --params '1e400' is too large: give a number up to 1e30", line
    assert "years" in ok("train-time", "--params", "1e30", "--tokens", "1e30", "--gpu", "h100")
    result = CliRunner().invoke(cli, ["diff", str(gpt_profile), str(gpt_profile), "--max-increase", "flops=1e400%"])
    assert result.exit_code == 2 and "--max-increase flops '1e400%' is too large" in result.stderr, result.output


def test_train_time_from_a_profile_without_tokens_is_a_usage_error(tmp_path):
    doc = {"schema": "fxacct.profile/1", "config": {"batch": 2, "tokens_per_example": None},
           "totals": {"forward_flops_by_class": {"matmul": 1, "attention": 0}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    line = usage_error("train-time", "--from", str(path), "--tokens", "1e9", "--gpu", "h100")
    assert "--tokens-per-example" in line, line


# --------------------------------------------------------------------------------------------------
# max-params
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shard, per_rank, expected, short", [
    # bytes per parameter on one rank, AdamW fp32 = 4 param + 4 grad + 8 state = 16, N = 8:
    ("none", 16, H100_NOMINAL // 16, "5B"),  # 80e9 / 16 = 5.0e9
    ("zero1", 9, H100_NOMINAL // 9, "8.9B"),  # 4 + 4 + 8/8 = 9 → 80e9 / 9 = 8,888,888,888
    ("zero2", Fraction(11, 2), H100_NOMINAL * 2 // 11, "14.5B"),  # 4 + (4 + 8)/8 = 5.5 → 14,545,454,545
    ("zero3", 2, H100_NOMINAL // 2, "40B"),  # 16/8 = 2 → 4e10, the seeds' (80e9 · 8) / 16
])
def test_max_params_seeds_and_sharding(shard, per_rank, expected, short):
    args = ["max-params", *SEEDS_MAX] + (["--shard", shard] if shard != "none" else [])
    doc = as_json(*args)
    assert doc["bytes_per_param"] == 16, doc
    assert Fraction(doc["bytes_per_param_per_rank"]) == per_rank, doc
    assert doc["max_params"] == expected, doc
    assert doc["capacity_bytes"] == H100_NOMINAL and doc["activations_included"] is False, doc
    out = ok(*args)
    assert f"max parameters: {short} ({expected:,})" in out, out
    assert "not included: activations" in out, out


def test_max_params_seeds_breakdown():
    doc = as_json("max-params", *SEEDS_MAX, "--shard", "zero3")
    parts = {p["category"]: p for p in doc["parts"]}
    # the seeds' table: 4 (weights) + 4 (gradients) + 4 (m) + 4 (v), all float32, all split 8 ways
    assert [(k, p["bytes_per_param"], p["ways"]) for k, p in parts.items()] == [
        ("parameters", 4, 8), ("gradients", 4, 8), ("optimizer_state", 8, 8)], doc
    assert [(s["name"], s["dtype"], s["bytes_per_param"]) for s in parts["optimizer_state"]["state"]] == [
        ("exp_avg", "float32", 4), ("exp_avg_sq", "float32", 4)], doc


def parts_of(*args: str) -> dict:
    doc = as_json("max-params", "--gpu", "h100", *args)
    return {p["category"]: (p["dtype"], p["bytes_per_param"]) for p in doc["parts"]} | {"total": doc["bytes_per_param"]}


def test_max_params_precision_flags():
    # --amp bf16: fp32 parameters and gradients, fp32 AdamW state: 4 + 4 + 8 = 16
    assert parts_of("--amp", "bf16") == {"parameters": ("float32", 4), "gradients": ("float32", 4),
                                         "optimizer_state": (None, 8), "total": 16}
    # --dtype bf16 --master-weights: 2 + 2 + 4 (fp32 master) + 8 (state of the fp32 masters) = 16
    assert parts_of("--dtype", "bf16", "--master-weights") == {
        "parameters": ("bfloat16", 2), "gradients": ("bfloat16", 2), "master_weights": ("float32", 4),
        "optimizer_state": (None, 8), "total": 16}
    # --dtype bf16 alone: AdamW state in bf16 too: 2 + 2 + 2·2 = 8
    assert parts_of("--dtype", "bf16")["total"] == 8
    out = ok("max-params", "--gpu", "h100", "--dtype", "bf16", "--master-weights")
    assert "master weights" in out and "exp_avg float32 4 + exp_avg_sq float32 4" in out, out


def test_max_params_optimizer_state_comes_from_the_class():
    assert parts_of("--optimizer", "sgd")["total"] == 8  # 4 + 4, no state
    assert parts_of("--optimizer", "sgd", "--optim-arg", "momentum=0.9")["total"] == 12  # + momentum_buffer 4
    assert parts_of("--optimizer", "adagrad")["total"] == 12  # + sum 4
    # RMSprop centered with momentum: square_avg + momentum_buffer + grad_avg = 12 → 20
    assert parts_of("--optimizer", "rmsprop", "--optim-arg", "momentum=0.9", "--optim-arg", "centered=True")[
        "total"] == 20


def test_max_params_with_an_explicit_memory():
    # 40GB / 16 = 2.5e9
    assert as_json("max-params", "--max-memory", "40GB")["max_params"] == 2_500_000_000


# --------------------------------------------------------------------------------------------------
# flops
# --------------------------------------------------------------------------------------------------

def test_flops_of_the_seeds_matmul():
    # (256×512) @ (512×256): 2 · 256 · 512 · 256 = 67,108,864
    assert as_json("flops", "--mm", "256x512x256")["flops"] == 2 * 256 * 512 * 256 == 67_108_864
    assert "67,108,864 FLOPs" in ok("flops", "--mm", "256x512x256")


def test_flops_six_n_d():
    assert as_json("flops", "--params", "70e9", "--tokens", "15e12")["flops"] == 6 * 70 * 15 * 10**21


# --------------------------------------------------------------------------------------------------
# bad inputs: exit 2, one line
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["train-time", "--params", "70e9", "--tokens", "15e12", "--gpu", "h100", "--mfu", "0"], "--mfu"),
    (["train-time", "--params", "70e9", "--tokens", "15e12", "--gpu", "h100", "--mfu", "1.5"], "--mfu"),
    (["train-time", "--params", "70e9", "--tokens", "-1", "--gpu", "h100"], "--tokens"),
    (["train-time", "--params", "70e9", "--tokens", "1.5", "--gpu", "h100"], "--tokens"),
    (["train-time", "--params", "lots", "--tokens", "1e9", "--gpu", "h100"], "--params"),
    (["train-time", "--tokens", "1e9", "--gpu", "h100"], "--params"),
    (["train-time", "--params", "1e9", "--tokens", "1e9", "--gpu", "b300"], "--gpu"),
    (["train-time", "--params", "1e9", "--tokens", "1e9"], "--gpu"),
    (["train-time", "--params", "1e9", "--tokens", "1e9", "--gpu", "h100", "--gpus", "0"], "--world-size"),
    (["train-time", "--from", str(ROOT / "tests" / "nowhere.json"), "--tokens", "1e9", "--gpu", "h100"],
     "nowhere.json"),
    (["max-params", "--world-size", "8"], "--gpu"),
    (["max-params", "--gpu", "h100", "--shard", "zero3"], "--world-size"),
    (["max-params", "--gpu", "h100", "--shard", "zero9", "--world-size", "8"], "--shard"),
    (["max-params", "--gpu", "h100", "--optimizer", "adamz"], "optimizer"),
    (["max-params", "--gpu", "h100", "--master-weights"], "--master-weights"),
    (["max-params", "--max-memory", "80XB"], "--max-memory"),
    (["flops", "--mm", "256x512"], "--mm"),
    (["flops", "--mm", "256x0x3"], "--mm"),
    (["flops", "--params", "70e9"], "--tokens"),
    (["flops"], "--mm"),
])
def test_bad_inputs_are_one_line_usage_errors(args, says):
    line = usage_error(*args)
    assert says in line, line


def test_train_time_from_a_mesh_profile_is_a_usage_error(gpt_profile, tmp_path):
    """A --mesh profile's FLOPs are one rank's share (a tp group's, a pipeline stage's): taken as the
    model's per token, they gave a training time 2-3× too short."""
    doc = json.loads(gpt_profile.read_text())
    doc["config"]["mesh"] = "tp=2"
    path = tmp_path / "rank.json"
    path.write_text(json.dumps(doc))
    line = usage_error("train-time", "--from", str(path), "--tokens", "1e12", "--gpu", "h100")
    assert "one rank's account under --mesh tp=2" in line, line
    doc["mesh"] = {"dims": {"pp": 2, "fsdp": 2}, "world_size": 4, "rank": 0, "model_params": 1}
    doc["config"]["mesh"] = "pp=2,fsdp=2"
    path.write_text(json.dumps(doc))
    line = usage_error("train-time", "--from", str(path), "--tokens", "1e12", "--gpu", "h100")
    assert "a share of the model's FLOPs" in line, line


def test_train_time_from_an_fsdp_profile_is_the_models(gpt_profile, tmp_path):
    """Under fsdp (and dp) each rank runs the whole model on its batch: its FLOPs per token are the
    model's, and N is the whole model's (the rank's totals.params is its shard). It was refused."""
    single = as_json("train-time", "--from", str(gpt_profile), "--tokens", "1e12", "--gpu", "h100")
    path = tmp_path / "fsdp.json"
    r = CliRunner().invoke(cli, ["profile", str(ROOT / "examples/gpt2.py") + ":GPT", "-k", "n_layer=1", "-k",
                                 "n_embd=32", "-k", "n_head=2", "-k", "block_size=16", "-k", "vocab_size=64",
                                 "--batch", "2", "--mesh", "fsdp=4", "--format", "json", "-o", str(path)])
    assert r.exit_code == 0, r.output
    assert json.loads(path.read_text())["totals"]["params"] < single["params"]  # the rank's shard
    sharded = as_json("train-time", "--from", str(path), "--tokens", "1e12", "--gpu", "h100")
    assert (sharded["flops_per_token"], sharded["params"]) == (single["flops_per_token"], single["params"])

"""The `fxacct` command line: every flag of `fxacct profile` has an effect checked against a number
computed by hand (in the comments), and every bad input gives exit code 2 (usage) or 3 (the model
failed), one `error:` line on stderr naming the problem and the fix, and no traceback unless
`--debug` asks for one (DESIGN.md, "Loading models" and "The JSON contract").

Broken or special models live one per file in tests/models/. Paths are relative to the repository
root, which every test runs in (the CLI resolves PATH.py against the working directory).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fxacct_cli.main import cli

ROOT = Path(__file__).resolve().parents[1]

TWO_LAYER = "examples/two_layer.py:TwoLayer"
DEEP_LINEAR = "examples/deep_linear.py:DeepLinearModel"
# A tiny GPT-2: 1 layer, C=32, 2 heads (hs=16), T=16, vocab 64. Parameters (lm_head tied to wte):
# wte 64·32=2048, wpe 16·32=512, block: ln_1 64, c_attn 32·96+96=3168, c_proj 32·32+32=1056,
# ln_2 64, c_fc 32·128+128=4224, mlp.c_proj 128·32+32=4128 (=12704), ln_f 64 → 15,328.
TINY_GPT = ["examples/gpt2.py:GPT", "-k", "n_layer=1", "-k", "n_embd=32", "-k", "n_head=2",
            "-k", "block_size=16", "-k", "vocab_size=64"]
MODELS = "tests/models"

# DESIGN.md, "The JSON contract": the stable top-level keys (`runtime` only with --runtime).
CONTRACT_TOP = {"schema", "model", "config", "conventions", "totals", "by_dtype", "modules", "nodes",
                "unsupported_ops"}
CONTRACT_CONFIG = {"batch", "dtype", "amp", "optimizer", "gpu", "world_size", "shard",
                   "tokens_per_example", "inputs"}
CONTRACT_TOTALS = {"forward_flops", "backward_flops", "loss_flops", "forward_flops_by_class",
                   "backward_flops_by_class", "params", "trainable_params", "param_bytes", "grad_bytes",
                   "optimizer_bytes", "activation_bytes", "peak_train_bytes", "peak_inference_bytes",
                   "predicted_step_ms"}
CONTRACT_NODE = {"name", "op", "module", "shape", "dtype", "forward_flops", "backward_flops",
                 "activation_bytes", "output_bytes", "kind"}
CONTRACT_MODULE = {"module", "forward_flops", "backward_flops", "activation_bytes"}


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _runner() -> CliRunner:
    try:  # click < 8.2 mixes stderr into output unless told not to
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2: stderr is always captured separately
        return CliRunner()


def invoke(*args: str):
    return _runner().invoke(cli, list(args), catch_exceptions=False)


def shown(result) -> str:
    return f"exit code {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def profile(*args: str):
    result = invoke("profile", *args)
    assert result.exit_code == 0, shown(result)
    return result


def profile_json(*args: str) -> dict:
    return json.loads(profile(*args, "--format", "json").stdout)


def table_section(text: str, title_start: str) -> list[list[str]]:
    """The data rows (split on whitespace) of the text table whose title (or header) line starts
    with `title_start`: the rows follow the first dashed line after it; a blank line ends them."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_start))
    dashes = next(i for i in range(start, len(lines)) if lines[i].strip() and set(lines[i].replace(" ", "")) == {"-"})
    assert dashes - start <= 2, text
    rows = []
    for line in lines[dashes + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


# --------------------------------------------------------------------------------------------------
# Flags and their effects
# --------------------------------------------------------------------------------------------------

def test_two_layer_defaults_match_hand_count():
    # TwoLayer: y = x @ w1 @ w2, B=2, D=H=3, K=2.
    # forward  = 2·B·(D·H + H·K) = 2·2·(9 + 6) = 60
    # backward = dW2 2·B·H·K (24) + dH 2·B·K·H (24) + dW1 2·B·D·H (36) = 84   (no dX by default)
    # params   = 3·3 + 3·2 = 15 → 60 bytes in float32
    doc = profile_json(TWO_LAYER, "--batch", "2")
    t = doc["totals"]
    assert (t["forward_flops"], t["backward_flops"]) == (60, 84), t
    assert t["forward_flops_by_class"] == {"matmul": 60, "attention": 0, "other": 0}, t
    assert t["backward_flops_by_class"] == {"matmul": 84, "attention": 0, "other": 0}, t
    assert (t["params"], t["trainable_params"], t["param_bytes"], t["grad_bytes"]) == (15, 15, 60, 60), t
    assert doc["config"]["batch"] == 2 and doc["config"]["inputs"] == ["float32[2,3]"], doc["config"]
    assert doc["config"]["dtype"] is None, doc["config"]
    assert doc["model"] == TWO_LAYER


def test_table_is_the_default_format():
    out = profile(TWO_LAYER, "--batch", "2").stdout
    assert out.startswith(f"fxacct profile: {TWO_LAYER}"), out
    assert "batch 2, inputs float32[2,3]" in out, out
    # FLOPs table: forward 60, backward 84, forward+backward 144
    total_row = next(r for r in table_section(out, "FLOPs ") if r[0] == "total")
    assert total_row == ["total", "60", "84", "144"], out
    assert "Traceback" not in out


def test_short_batch_flag_and_debug_on_success_change_nothing():
    assert profile_json(TWO_LAYER, "-b", "2") == profile_json(TWO_LAYER, "--batch", "2", "--debug")


def test_input_requires_grad_adds_the_input_gradient():
    # dX = dH @ w1ᵀ: 2·B·H·D = 2·2·3·3 = 36 → backward 84 + 36 = 120; forward unchanged.
    t = profile_json(TWO_LAYER, "--batch", "2", "--input-requires-grad")["totals"]
    assert (t["forward_flops"], t["backward_flops"]) == (60, 120), t


def test_batch_4_doubles_the_batch_2_flops():
    # Every FLOP term is linear in B: 2·4·15 = 120 forward, 84·2 = 168 backward.
    t2 = profile_json(TWO_LAYER, "--batch", "2")["totals"]
    t4 = profile_json(TWO_LAYER, "--batch", "4")["totals"]
    assert (t4["forward_flops"], t4["backward_flops"]) == (120, 168), t4
    assert t4["forward_flops"] == 2 * t2["forward_flops"]
    assert t4["params"] == t2["params"] == 15  # parameters do not grow with the batch
    # The tiny GPT: forward matmul per token = 2·C·(3C + C + 4C + 4C) + 2·C·V
    #   = 2·32·(96 + 32 + 128 + 128) + 2·32·64 = 24576 + 4096 = 28672; B·T = 2·16 = 32 → 917,504.
    g2 = profile_json(*TINY_GPT, "--batch", "2")
    g4 = profile_json(*TINY_GPT, "--batch", "4")
    assert g2["totals"]["forward_flops_by_class"]["matmul"] == 917_504, g2["totals"]
    assert g4["totals"]["forward_flops_by_class"]["matmul"] == 2 * 917_504, g4["totals"]
    assert g4["config"]["inputs"] == ["int64[4,16]"], g4["config"]


@pytest.mark.parametrize("flag, torch_name", [("bf16", "bfloat16"), ("torch.float16", "float16"),
                                              ("bfloat16", "bfloat16")])
def test_dtype_halves_param_bytes_and_is_echoed(flag, torch_name):
    # 15 parameters: 15·4 = 60 bytes in float32, 15·2 = 30 in a 16-bit dtype (gradients likewise).
    doc = profile_json(TWO_LAYER, "--batch", "2", "--dtype", flag)
    t = doc["totals"]
    assert (t["param_bytes"], t["grad_bytes"]) == (30, 30), t
    assert (t["forward_flops"], t["backward_flops"]) == (60, 84), t  # FLOPs do not depend on dtype
    assert doc["config"]["dtype"] == torch_name, doc["config"]
    assert doc["config"]["inputs"] == [f"{torch_name}[2,3]"], doc["config"]  # floating inputs are cast
    assert doc["by_dtype"][torch_name]["param_bytes"] == 30, doc["by_dtype"]
    assert doc["by_dtype"][torch_name]["grad_bytes"] == 30, doc["by_dtype"]
    # No float32 parameters or gradients remain (AdamW's float32 `step` counters may be listed).
    for name, row in doc["by_dtype"].items():
        if name != torch_name:
            assert row["param_bytes"] == 0 and row["grad_bytes"] == 0, doc["by_dtype"]


def test_causal_attention_halved_halves_attention_flops_only():
    # The GPT example calls SDPA with is_causal=True. Per layer, QKᵀ and AV are 2·B·T·T·C each:
    # 4·B·T²·C = 4·2·16²·32 = 65,536 forward; backward for q, k and v is 2× forward = 131,072.
    full = profile_json(*TINY_GPT, "--batch", "2")
    half = profile_json(*TINY_GPT, "--batch", "2", "--causal-attention", "halved")
    assert full["conventions"]["causal_attention"] == "full", full["conventions"]
    assert half["conventions"]["causal_attention"] == "halved", half["conventions"]
    assert full["conventions"]["flops_per_fma"] == 2, full["conventions"]
    f, h = full["totals"], half["totals"]
    assert f["forward_flops_by_class"]["attention"] == 65_536, f
    assert f["backward_flops_by_class"]["attention"] == 131_072, f
    assert h["forward_flops_by_class"]["attention"] == 32_768, h
    assert h["backward_flops_by_class"]["attention"] == 65_536, h
    for phase in ("forward_flops_by_class", "backward_flops_by_class"):
        for cls in ("matmul", "other"):
            assert h[phase][cls] == f[phase][cls], (phase, cls, f, h)
    assert h["forward_flops"] == f["forward_flops"] - 32_768
    table = profile(*TINY_GPT, "--batch", "2", "--causal-attention", "halved").stdout
    assert "attention halved" in table, table  # the convention is stated in the table too


def test_causal_attention_explicit_full_is_the_default():
    assert profile_json(*TINY_GPT, "--causal-attention", "full") == profile_json(*TINY_GPT)


def test_json_has_the_contract_keys():
    # DESIGN.md: the contract's keys are stable; "more may be added; none may change meaning".
    # So every contract key must be there, and `runtime` only with --runtime.
    doc = profile_json(TWO_LAYER, "--batch", "2")
    assert set(doc) >= CONTRACT_TOP, sorted(doc)
    assert "runtime" not in doc, sorted(doc)
    assert doc["schema"] == "fxacct.profile/1"
    assert set(doc["config"]) >= CONTRACT_CONFIG, sorted(doc["config"])
    assert set(doc["totals"]) >= CONTRACT_TOTALS, sorted(doc["totals"])
    assert set(doc["totals"]["forward_flops_by_class"]) == {"matmul", "attention", "other"}, doc["totals"]
    assert set(doc["conventions"]) >= {"flops_per_fma", "causal_attention"}, doc["conventions"]
    for node in doc["nodes"]:
        assert set(node) >= CONTRACT_NODE, node
    for module in doc["modules"]:
        assert set(module) >= CONTRACT_MODULE, module
    assert doc["unsupported_ops"] == {}, doc["unsupported_ops"]
    # One `input` node for x, then the two forward matmuls; per-node figures sum to the totals.
    assert [n["kind"] for n in doc["nodes"]] == ["input", "compute", "compute"], doc["nodes"]
    assert sum(n["forward_flops"] for n in doc["nodes"]) == 60
    assert sum(n["backward_flops"] for n in doc["nodes"]) == 84


def test_csv_has_a_header_and_one_row_per_forward_node():
    doc = profile_json(TWO_LAYER, "--batch", "2")
    text = profile(TWO_LAYER, "--batch", "2", "--format", "csv").stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    header = text.splitlines()[0].split(",")
    assert {"name", "op", "module", "shape", "dtype", "kind", "forward_flops", "backward_flops",
            "activation_bytes", "output_bytes"} <= set(header), header
    assert len(rows) == len(doc["nodes"]) == 3, text  # x (input), mm, mm_1
    assert [r["name"] for r in rows] == [n["name"] for n in doc["nodes"]], text
    # x@w1: 2·2·3·3 = 36 forward; (x@w1)@w2: 2·2·3·2 = 24 forward; sums 60 / 84 as in the totals
    assert sum(int(r["forward_flops"]) for r in rows) == 60, text
    assert sum(int(r["backward_flops"]) for r in rows) == 84, text


def test_csv_by_module_has_one_row_per_module():
    doc = profile_json(*TINY_GPT, "--batch", "2")
    text = profile(*TINY_GPT, "--batch", "2", "--format", "csv", "--by", "module").stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    assert "module" in text.splitlines()[0].split(","), text
    # the root module is "(root)", as in the text table (its JSON name stays "")
    assert [r["module"] for r in rows] == [m["module"] or "(root)" for m in doc["modules"]], text
    root = next(r for r in rows if r["module"] == "(root)")
    assert int(root["forward_flops"]) == doc["totals"]["forward_flops"], text
    lm_head = next(r for r in rows if r["module"] == "lm_head")
    assert int(lm_head["forward_flops"]) == 2 * 32 * 32 * 64  # B·T=32 tokens, C=32, V=64: 131,072


def test_markdown_has_summary_totals_and_tables():
    # Pipe tables under headings; the per-module table by default, per-node with --by node. Parsed as
    # tables (markdown-it-py) in tests/test_markdown.py; here the rows and figures.
    text = profile(TWO_LAYER, "--batch", "2", "--format", "markdown", "--by", "node").stdout
    assert text.startswith("### fxacct profile: `examples/two_layer.py:TwoLayer`"), text
    rows = [line for line in text.split("#### Forward nodes")[1].splitlines() if line.startswith("|")]
    assert "node" in rows[0] and "forward FLOPs" in rows[0], text
    assert set(rows[1].replace("|", "").replace(" ", "")) <= {"-", ":"}, text  # the separator row
    assert len(rows) == 2 + 3, text  # header, separator, x / mm / mm_1
    assert "| forward + backward FLOPs" in text and "144 |" in text, text  # 60 forward + 84 backward
    by_module = profile(*TINY_GPT, "--format", "markdown").stdout
    mlines = [line for line in by_module.split("#### Modules (depth 2")[1].splitlines() if line.startswith("|")]
    assert "module" in mlines[0], by_module
    # depth 2 by default, as the text table: root, wte, wpe, h, h.0, ln_f, lm_head
    assert len(mlines) == 2 + 7, by_module
    assert not any("`h.0.attn" in line for line in mlines), by_module
    assert mlines[2].startswith("| (root)"), by_module  # the root is named, not blank
    every = profile(*TINY_GPT, "--format", "markdown", "--depth", "9").stdout
    mlines = [line for line in every.split("#### Modules")[1].splitlines() if line.startswith("|")]
    assert len(mlines) == 2 + 16, every  # 16 modules in named_modules() of the tiny GPT
    assert any("`h.0.attn.c_attn`" in line for line in mlines), every


def test_depth_limits_the_module_table():
    out1 = profile(*TINY_GPT, "--depth", "1").stdout
    names1 = [r[0] for r in table_section(out1, "modules (depth 1")]
    assert names1 == ["(root)", "wte", "wpe", "h", "ln_f", "lm_head"], out1
    out2 = profile(*TINY_GPT, "--depth", "2").stdout
    names2 = [r[0] for r in table_section(out2, "modules (depth 2")]
    assert "h.0" in names2 and "h.0.attn" not in names2, out2
    out0 = profile(*TINY_GPT, "--depth", "0").stdout
    assert [r[0] for r in table_section(out0, "modules (depth 0")] == ["(root)"], out0


def test_top_3_lists_three_nodes_by_flops():
    # Forward+backward per node at B·T = 32 tokens, C = 32 (matmul 2·32·in·out fwd, ≈2× bwd):
    # c_fc 32→128 and mlp.c_proj 128→32 (262,144 matmul each fwd), then c_attn 32→96 (196,608),
    # then lm_head 32→64 (131,072) — so the top 3 are the two MLP matmuls and c_attn.
    out = profile(*TINY_GPT, "--batch", "2", "--top", "3").stdout
    rows = table_section(out, "top 3 nodes")
    assert len(rows) == 3, out
    assert {r[2] for r in rows} == {"h.0.mlp.c_fc", "h.0.mlp.c_proj", "h.0.attn.c_attn"}, out
    out1 = profile(*TINY_GPT, "--batch", "2", "--top", "1").stdout
    assert len(table_section(out1, "top 1 node")) == 1, out1


def test_output_file_gets_the_document_and_stdout_stays_empty(tmp_path):
    target = tmp_path / "out.json"
    result = profile(TWO_LAYER, "--batch", "2", "--format", "json", "-o", str(target))
    assert result.stdout == "", shown(result)
    assert str(target) in result.stderr, shown(result)  # "wrote FILE" goes to stderr
    doc = json.loads(target.read_text())
    assert doc["totals"]["forward_flops"] == 60
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind
    csv_target = tmp_path / "nodes.csv"
    result = profile(TWO_LAYER, "--batch", "2", "--format", "csv", "--output", str(csv_target))
    assert result.stdout == "", shown(result)
    assert len(list(csv.DictReader(io.StringIO(csv_target.read_text())))) == 3


def test_output_dash_means_stdout():
    result = profile(TWO_LAYER, "--format", "json", "-o", "-")
    assert json.loads(result.stdout)["totals"]["forward_flops"] == 30  # B=1: 2·1·15


def test_input_overrides_example_inputs():
    # A fixed first dimension of 7 (not B) while --batch 2: forward 2·7·(9 + 6) = 210.
    doc = profile_json(TWO_LAYER, "--batch", "2", "--input", "float32[7,3]")
    assert doc["config"]["inputs"] == ["float32[7,3]"], doc["config"]
    assert doc["totals"]["forward_flops"] == 210, doc["totals"]
    # Keyword form, B = --batch = 5: 2·5·15 = 150
    doc = profile_json(TWO_LAYER, "--batch", "5", "--input", "x=float32[B,3]")
    assert doc["config"]["inputs"] == ["float32[5,3]"], doc["config"]
    assert doc["totals"]["forward_flops"] == 150, doc["totals"]
    # GPT with T=8 instead of block_size 16; `<64` bounds token ids. Attention 4·B·T²·C =
    # 4·2·64·32 = 16,384; matmul 28,672 per token · 16 tokens = 458,752; tokens per example 8.
    doc = profile_json(*TINY_GPT, "--batch", "2", "--input", "long[B,8]<64")
    assert doc["config"]["tokens_per_example"] == 8, doc["config"]
    assert doc["totals"]["forward_flops_by_class"]["attention"] == 16_384, doc["totals"]
    assert doc["totals"]["forward_flops_by_class"]["matmul"] == 458_752, doc["totals"]


def test_input_supplies_inputs_to_a_module_without_example_inputs():
    # NoInputs: Linear(3, 2, bias=False), B=2: forward 2·2·3·2 = 24; 6 parameters.
    t = profile_json(f"{MODELS}/no_inputs.py:NoInputs", "--batch", "2", "--input", "float32[B,3]")["totals"]
    assert (t["forward_flops"], t["params"]) == (24, 6), t


def test_file_level_example_inputs_function_is_used():
    # TwoOutputs has no example_inputs method; the file defines example_inputs(batch) → float32[B,3].
    doc = profile_json(f"{MODELS}/two_outputs.py:TwoOutputs", "--batch", "2")
    assert doc["config"]["inputs"] == ["float32[2,3]"], doc["config"]


@pytest.mark.parametrize("args", [
    ["--kwargs", '{"num_layers": 2}'],
    ["-k", "num_layers=2"],
    ["--kwarg", "num_layers=2"],
    ["--kwargs", '{"num_layers": 5}', "-k", "num_layers=2"],  # -k wins over --kwargs
])
def test_constructor_arguments(args):
    # DeepLinearModel(num_layers=2): two 3×3 matrices and a bias of 3 → 3·3·2 + 3 = 21 params.
    # Forward at B=2: two matmuls 2·2·3·3 = 36 each (72) + the bias add 2·3 = 6 → 78 in total.
    t = profile_json(DEEP_LINEAR, "--batch", "2", *args)["totals"]
    assert t["params"] == 21, t
    assert t["forward_flops_by_class"]["matmul"] == 72, t


def test_kwarg_values_are_python_literals():
    # -k bias=False drops every bias: c_attn 96, attn.c_proj 32, c_fc 128, mlp.c_proj 32 and the three
    # LayerNorm biases 3·32 = 96 → 15,328 − 384 = 14,944 parameters. A string "False" would be truthy.
    assert profile_json(*TINY_GPT)["totals"]["params"] == 15_328
    assert profile_json(*TINY_GPT, "-k", "bias=False")["totals"]["params"] == 14_944


def test_tokens_per_example():
    # TwoLayer has a float input, so no token count unless given: null by default.
    assert profile_json(TWO_LAYER)["config"]["tokens_per_example"] is None
    doc = profile_json(TWO_LAYER, "--batch", "2", "--tokens-per-example", "7")
    assert doc["config"]["tokens_per_example"] == 7, doc["config"]
    # 6·N·D with N = 15 parameters and D = batch × tokens = 2·7 = 14 → 1,260
    out = profile(TWO_LAYER, "--batch", "2", "--tokens-per-example", "7").stdout
    assert "7 tokens per example" in out, out
    assert "N=15, D=14" in out and "1.260k" in out, out
    # GPT: the first integer input is long[2,16], so T = 16 without the flag; the flag overrides it.
    assert profile_json(*TINY_GPT, "--batch", "2")["config"]["tokens_per_example"] == 16
    assert profile_json(*TINY_GPT, "--tokens-per-example", "4")["config"]["tokens_per_example"] == 4


def test_loss_output_picks_one_output():
    # TwoOutputs returns (x@w1, x@w2), w1 3×4 and w2 3×2, B=2. Forward 2·2·3·4 + 2·2·3·2 = 48 + 24.
    # Loss on both: dW1 = 48, dW2 = 24 → 72; on output 0 only dW1 (48); on output 1 only dW2 (24).
    # Gradients exist only for the parameter that reaches the loss: 12·4 = 48 or 6·4 = 24 bytes.
    both = profile_json(f"{MODELS}/two_outputs.py:TwoOutputs", "--batch", "2")["totals"]
    first = profile_json(f"{MODELS}/two_outputs.py:TwoOutputs", "--batch", "2", "--loss-output", "0")["totals"]
    second = profile_json(f"{MODELS}/two_outputs.py:TwoOutputs", "--batch", "2", "--loss-output", "1")["totals"]
    assert (both["forward_flops"], both["backward_flops"], both["grad_bytes"]) == (72, 72, 72), both
    assert (first["forward_flops"], first["backward_flops"], first["grad_bytes"]) == (72, 48, 48), first
    assert (second["forward_flops"], second["backward_flops"], second["grad_bytes"]) == (72, 24, 24), second


def test_version_and_help():
    result = invoke("--version")
    assert result.exit_code == 0 and "0.1.0" in result.stdout, shown(result)
    for args in (["--help"], ["-h"], ["profile", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0, shown(result)
        assert result.stdout.startswith("Usage:"), shown(result)
        assert result.stderr == "", shown(result)
    text = invoke("profile", "--help").stdout
    for flag in ("--batch", "--dtype", "--kwargs", "--kwarg", "--input", "--input-requires-grad",
                 "--loss-output", "--causal-attention", "--tokens-per-example", "--debug", "--format",
                 "--by", "--depth", "--top", "--output"):
        assert flag in text, (flag, text)


def test_no_arguments_shows_help_not_an_error():
    # `fxacct` alone should print the usage (click exits 2 for no_args_is_help since 8.2, 0 before),
    # not the usage text dressed up as "error: Usage: ..." with a "(see 'fxacct --help')" tail.
    result = invoke()
    assert result.exit_code in (0, 2), shown(result)
    assert "Usage:" in result.output and "profile" in result.output, shown(result)
    assert not result.stderr.startswith("error:"), shown(result)
    assert "see 'fxacct --help'" not in result.output, shown(result)


@pytest.mark.slow  # a whole process; test_python_dash_m_fxacct_runs_the_cli stays fast
def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "fxacct_cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Usage:") and "profile" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------------------------------
# Bad inputs: exit 2 (usage) or 3 (model failed), one "error:" line naming problem and fix
# --------------------------------------------------------------------------------------------------

def assert_one_line_error(result, code: int, *fragments: str) -> str:
    msg = shown(result)
    assert result.exit_code == code, msg
    assert "Traceback" not in result.stdout and "Traceback" not in result.stderr, msg
    assert result.stdout == "", msg  # nothing half-printed on stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, msg
    assert lines[0].startswith("error:"), msg
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, msg)
    return lines[0]


GPT_TARGET = TINY_GPT[0]

# (id, args after `profile`, exit code, fragments the one line must contain, expect a traceback with --debug)
BAD_INPUTS = [
    # --- the model target ---
    ("missing-file", ["nope_missing.py:X"], 2, ["nope_missing.py", "not found", "path"], True),
    ("missing-file-in-dir", ["examples/nope.py:GPT"], 2, ["examples/nope.py", "not found"], True),
    ("no-colon", ["examples/two_layer.py"], 2, ["examples/two_layer.py", "PATH.py:Name"], True),
    ("not-a-py-file", ["./README.md:X"], 2, ["'./README.md'", "not a Python file"], True),  # was exit 4
    # a ModuleList runs no forward: checkpointing it changed nothing, silently
    ("checkpoint-a-container", ["examples/mlp.py:MLP", "--checkpoint", "blocks"], 2,
     ["'blocks', a ModuleList", "'blocks.*'"], True),
    # a class is callable but no policy: torch called it inside the forward ("the model's forward raised", exit 3)
    ("checkpoint-policy-a-class", ["examples/mlp.py:MLP", "--checkpoint", "blocks.*", "--checkpoint-policy",
                                   f"{MODELS}/not_a_module.py:NotATorchModule"], 2,
     ["--checkpoint-policy", "NotATorchModule is no policy fn(ctx, op"], True),
    ("a-directory", ["examples/ci:GPT"], 2, ["'examples/ci' is a directory", "defines GPT", "hf:examples/ci"], True),
    ("empty-name", ["examples/two_layer.py:"], 2, ["PATH.py:Name"], True),
    ("syntax-error", [f"{MODELS}/syntax_error.py:Broken"], 3, ["syntax_error.py:5", "syntax error"], True),
    ("import-fails", [f"{MODELS}/import_fails.py:Anything"], 3,
     ["import_fails.py", "fxacct_no_such_package_xyz"], True),
    ("missing-name", ["examples/two_layer.py:Nope"], 2, ["'Nope'", "TwoLayer"], True),
    ("name-is-a-string", [f"{MODELS}/not_a_module.py:GREETING"], 2, ["GREETING", "str", "nn.Module"], True),
    ("factory-returns-int", [f"{MODELS}/not_a_module.py:make_int"], 2, ["make_int", "int", "nn.Module"], True),
    ("class-not-a-module", [f"{MODELS}/not_a_module.py:NotATorchModule"], 2,
     ["NotATorchModule", "nn.Module"], True),
    ("ctor-needs-args", [f"{MODELS}/needs_args.py:NeedsArgs"], 2, ["d_in", "d_out", "-k d_in="], True),
    ("ctor-needs-one-more", [f"{MODELS}/needs_args.py:NeedsArgs", "-k", "d_in=4"], 2,
     ["d_out", "-k d_out="], True),
    ("ctor-unexpected-arg", [f"{MODELS}/needs_args.py:NeedsArgs", "-k", "d_in=4", "-k", "d_out=2",
                             "-k", "extra=1"], 2, ["extra", "-k"], True),
    ("ctor-raises", [f"{MODELS}/ctor_raises.py:CtorRaises", "-k", "width=3"], 3,
     ["CtorRaises", "ValueError", "width must be even"], True),
    ("no-inputs", [f"{MODELS}/no_inputs.py:NoInputs"], 2, ["--input", "example_inputs"], True),
    # --- the model's forward ---
    ("forward-raises", [f"{MODELS}/forward_raises.py:ForwardRaises"], 3,
     ["RuntimeError", "forward is broken on purpose"], True),
    ("data-dependent-control-flow", [f"{MODELS}/data_dependent.py:DataDependent"], 3,
     ["tensor values", "fake tensors"], True),
    ("input-shape-mismatch", [TWO_LAYER, "--input", "float32[B,5]"], 3, ["[1, 5]"], True),
    # eager's mm refuses int64 @ float32; the meta kernel does not, and the step was accounted as if it ran
    ("input-dtype-mismatch", [TWO_LAYER, "--input", "long[B,3]"], 3,
     ["the model's forward runs aten.mm.default on tensors of int64, float32", "eager PyTorch refuses"], True),
    # --- malformed --input ---
    ("input-no-brackets", [TWO_LAYER, "--input", "float32"], 2, ["--input", "'float32'", "DTYPE[DIM"], True),
    ("input-unclosed", [TWO_LAYER, "--input", "float32[B,3"], 2, ["'float32[B,3'", "DTYPE[DIM"], True),
    ("input-bad-dim", [TWO_LAYER, "--input", "float32[B,x]"], 2, ["'x'", "positive integer or B"], True),
    ("input-lowercase-b", [TWO_LAYER, "--input", "float32[b,3]"], 2, ["'b'", "positive integer or B"], True),
    ("input-zero-dim", [TWO_LAYER, "--input", "float32[B,0]"], 2, ["'0'", "positive integer"], True),
    ("input-negative-dim", [TWO_LAYER, "--input", "float32[B,-3]"], 2, ["'-3'", "positive integer"], True),
    ("input-empty-dim", [TWO_LAYER, "--input", "float32[B,,3]"], 2, ["positive integer"], True),
    ("input-unknown-dtype", [TWO_LAYER, "--input", "nosuch[B,3]"], 2, ["'nosuch'", "bf16"], True),
    ("input-no-dtype", [TWO_LAYER, "--input", "[B,3]"], 2, ["'[B,3]'", "DTYPE[DIM"], True),
    ("input-empty", [TWO_LAYER, "--input", ""], 2, ["--input", "DTYPE[DIM"], True),
    ("input-bad-name", [TWO_LAYER, "--input", "1x=float32[B,3]"], 2, ["'1x=float32[B,3]'"], True),
    ("input-bound-on-float", [TWO_LAYER, "--input", "float32[B,3]<10"], 2, ["'<10'", "integer"], True),
    ("input-bound-not-a-number", [GPT_TARGET, "--input", "long[B,4]<abc"], 2, ["'long[B,4]<abc'"], True),
    # An integer input with a zero bound: the message must say the bound must be positive, not that
    # "'<0' bounds integer inputs only" (the dtype IS an integer one).
    ("input-bound-zero", [GPT_TARGET, "--input", "long[B,4]<0"], 2, ["'<0'", "positive"], True),
    # a negative bound said only "malformed", not why
    ("input-bound-negative", [GPT_TARGET, "--input", "long[B,4]<-5"], 2, ["'<-5'", "positive"], True),
    # one flag "takes" effect, several "take" (it said "take(s)")
    ("runtime-flag-alone", [GPT_TARGET, "--inference"], 2, ["--inference takes effect with --runtime"], True),
    ("runtime-flags", [GPT_TARGET, "--inference", "--device", "cpu"], 2, ["take effect with --runtime"], True),
    # ids drawn below 100 index GPT's 64-row token table: eager raises IndexError; the meta kernel would not
    ("input-ids-past-the-table", [*TINY_GPT, "--input", "long[B,4]<100"], 3,
     ["looks up ids up to 99 in an embedding of 64 rows", "--input ...<64"], True),
    # --- --dtype ---
    ("dtype-unknown", [TWO_LAYER, "--dtype", "fp13"], 2, ["'fp13'", "bf16"], True),
    ("dtype-empty", [TWO_LAYER, "--dtype", ""], 2, ["dtype", "bf16"], True),
    # An integer --dtype cannot carry gradients: a usage error naming the floating dtypes, not exit 1.
    ("dtype-integer", [TWO_LAYER, "--dtype", "long"], 2, ["--dtype", "bf16"], True),
    ("dtype-bool", [TWO_LAYER, "--dtype", "bool"], 2, ["--dtype", "bf16"], True),
    # --- numbers ---
    ("batch-zero", [TWO_LAYER, "--batch", "0"], 2, ["--batch", "positive", "0"], True),
    ("batch-negative", [TWO_LAYER, "--batch", "-1"], 2, ["--batch", "positive", "-1"], True),
    ("batch-not-int", [TWO_LAYER, "--batch", "two"], 2, ["--batch", "'two'", "integer"], False),
    ("tokens-zero", [TWO_LAYER, "--tokens-per-example", "0"], 2, ["--tokens-per-example", "positive"], True),
    ("top-negative", [TWO_LAYER, "--top", "-1"], 2, ["--top"], False),
    ("depth-negative", [TWO_LAYER, "--depth", "-1"], 2, ["--depth"], False),
    # --- constructor arguments ---
    ("kwarg-no-equals", [TWO_LAYER, "-k", "input_dim"], 2, ["-k", "'input_dim'", "NAME=VALUE"], True),
    ("kwarg-empty-name", [TWO_LAYER, "-k", "=3"], 2, ["NAME=VALUE"], True),
    ("kwarg-bad-name", [TWO_LAYER, "-k", "1a=3"], 2, ["'1a=3'", "NAME=VALUE"], True),
    ("kwargs-bad-json", [TWO_LAYER, "--kwargs", "{bad"], 2, ["--kwargs", "JSON", '{"d": 512}'], True),
    ("kwargs-single-quotes", [TWO_LAYER, "--kwargs", "{'input_dim': 3}"], 2, ["--kwargs", "JSON"], True),
    ("kwargs-not-object", [TWO_LAYER, "--kwargs", "[1, 2]"], 2, ["--kwargs", "JSON object"], True),
    # --- --loss-output ---
    ("loss-output-too-big", [f"{MODELS}/two_outputs.py:TwoOutputs", "--loss-output", "2"], 2,
     ["--loss-output 2", "0 to 1"], True),
    ("loss-output-negative", [f"{MODELS}/two_outputs.py:TwoOutputs", "--loss-output", "-3"], 2,
     ["--loss-output -3", "0 to 1"], True),
    ("loss-output-single-output", [TWO_LAYER, "--loss-output", "1"], 2, ["--loss-output 1", "0"], True),
    # --- files other flags name: the hint names the flag and the kind of class it wants ---
    ("parallelize-syntax-error", [TWO_LAYER, "--mesh", "fsdp=2", "--parallelize", f"{MODELS}/syntax_error.py:fn"],
     3, ["syntax_error.py:5", "fix the --parallelize file"], True),
    ("optimizer-syntax-error", [TWO_LAYER, "--optimizer", f"{MODELS}/syntax_error.py:Opt"], 3,
     ["syntax_error.py:5", "fix the --optimizer file"], True),
    ("optimizer-missing-file", [TWO_LAYER, "--optimizer", "no_such_optimizer.py:X"], 2,
     ["--optimizer file 'no_such_optimizer.py' not found"], True),
    ("optimizer-missing-name", [TWO_LAYER, "--optimizer", f"{MODELS}/my_optimizer.py:Nope"], 2,
     ["--optimizer", "'Nope'", "torch.optim.Optimizer classes defined there: PlainSGD"], True),
    # --- what fxacct cannot account, or what another flag names, failing on its own ---
    ("sparse-gradient", [f"{MODELS}/sparse_embedding.py:SparseEmbedding"], 3,
     ["the model's backward makes a sparse_coo tensor", "sparse=False"], True),
    ("optimizer-reads-a-value", [TWO_LAYER, "--optimizer", f"{MODELS}/step_reads_values.py:ItemSGD"], 2,
     ["the optimizer's step reads a tensor's value", "--optimizer"], True),
    # 2^61 elements: a count torch holds, 2^63 bytes of float32 it cannot
    ("input-too-large", [TWO_LAYER, "--input", "float32[2305843009213693952]"], 2,
     ["--input", "more than torch can address", "smaller"], True),
    ("plot-unknown-format", [TWO_LAYER, "--plot", "timeline.txt"], 2, ["--plot timeline.txt", "'.txt'", ".png"], False),
    ("checkpoint-policy-factory-returns-a-module",
     [f"{MODELS}/step_reads_values.py:Blocks", "--checkpoint", "blocks.*", "--checkpoint-policy",
      f"{MODELS}/step_reads_values.py:module_factory"], 2, ["module_factory() returned a Sequential", "policy fn"], True),
    ("checkpoint-policy-raises",
     [f"{MODELS}/step_reads_values.py:Blocks", "--checkpoint", "blocks.*", "--checkpoint-policy",
      f"{MODELS}/step_reads_values.py:raising_policy"], 2, ["raising_policy raised KeyError", "CheckpointPolicy"], True),
    # --- click-level usage errors ---
    ("unknown-option", [TWO_LAYER, "--frobnicate"], 2, ["--frobnicate", "--help"], False),
    ("unknown-format", [TWO_LAYER, "--format", "xml"], 2, ["--format", "'xml'", "json"], False),
    ("unknown-by", [TWO_LAYER, "--by", "layer"], 2, ["--by", "module"], False),
    ("unknown-causal", [TWO_LAYER, "--causal-attention", "half"], 2, ["--causal-attention", "halved"], False),
    ("missing-target", [], 2, ["PATH.py:NAME", "--help"], False),
    # --- -o FILE ---
    ("output-dir-missing", [TWO_LAYER, "-o", "no_such_dir_fxacct/out.json"], 2,
     ["no_such_dir_fxacct", "does not exist"], True),
]


@pytest.mark.parametrize("args, code, fragments, debug_traceback",
                         [pytest.param(a, c, f, d, id=i) for i, a, c, f, d in BAD_INPUTS])
def test_bad_input_is_one_error_line(args, code, fragments, debug_traceback):
    assert_one_line_error(invoke("profile", *args), code, *fragments)


@pytest.mark.parametrize("args, code",
                         [pytest.param(a, c, id=i) for i, a, c, _, d in BAD_INPUTS if d])
def test_debug_shows_the_traceback(args, code):
    result = invoke("profile", *args, "--debug")
    msg = shown(result)
    assert result.exit_code == code, msg
    assert "Traceback (most recent call last)" in result.stderr, msg
    assert result.stderr.splitlines()[-1].startswith("error:"), msg  # the one-line summary still ends it
    assert "--debug" not in result.stderr.splitlines()[-1], msg  # which no longer asks for it


def test_unknown_command():
    assert_one_line_error(invoke("nosuch"), 2, "nosuch", "--help")


def test_output_to_a_directory_is_a_usage_error(tmp_path):
    # -o naming an existing directory: exit 2 "cannot write DIR: it is a directory", not an internal error.
    assert_one_line_error(invoke("profile", TWO_LAYER, "-o", str(tmp_path)), 2, str(tmp_path), "directory")


@pytest.mark.parametrize("args", [
    [f"{MODELS}/forward_raises.py:ForwardRaises"],
    [f"{MODELS}/ctor_raises.py:CtorRaises", "-k", "width=3"],
    [f"{MODELS}/import_fails.py:Anything"],
], ids=["forward-raises", "ctor-raises", "import-fails"])
def test_model_failure_says_how_to_find_where(args):
    # An exception inside the user's model is the user's to fix; the one line should say how to find
    # where it was raised (rerun with --debug), since the message alone does not give the location.
    line = assert_one_line_error(invoke("profile", *args), 3)
    assert "--debug" in line, line


@pytest.mark.parametrize("where, body", [
    ("import", "import sys\nsys.exit(0)\n"),
    ("constructor", "import sys, torch\nclass M(torch.nn.Module):\n    def __init__(self):\n"
                    "        super().__init__()\n        sys.exit(3)\n"),
    ("forward", "import sys, torch\nclass M(torch.nn.Module):\n    def __init__(self):\n"
                "        super().__init__()\n        self.lin = torch.nn.Linear(4, 4)\n"
                "    def forward(self, x):\n        sys.exit('bye')\n"),
], ids=["import", "constructor", "forward"])
def test_the_models_sys_exit_is_its_failure(tmp_path, where, body):
    # SystemExit is no Exception: it left through every handler with the model's own code (0: a silent
    # "success"; a message: exit 1, which the CLI keeps for a failed budget)
    path = tmp_path / "exits.py"
    path.write_text(body)
    line = assert_one_line_error(invoke("profile", f"{path}:M", "--input", "float[B,4]"), 3, "SystemExit",
                                 f"{path}:{body.count(chr(10))}")
    assert "internal error" not in line, line


def test_a_wrong_input_dtype_caught_by_a_kernel_is_the_models_failure(tmp_path):
    """A conv given a long tensor fails in torch's C++ kernel, reached through the recorder's
    function mode that forwards the call: the model's failure (exit 3) at the model's line, not
    fxacct's internal error (4), which it once was."""
    (tmp_path / "conv.py").write_text(
        "from torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.c = nn.Conv2d(3, 8, 3)\n\n"
        "    def forward(self, x):\n"
        "        return self.c(x)\n")
    result = invoke("profile", str(tmp_path / "conv.py") + ":Net", "--input", "long[B,3,16,16]")
    line = assert_one_line_error(result, 3)
    assert "conv.py:9" in line, line


def test_a_model_where_nothing_trains_says_so(tmp_path):
    """Every parameter frozen and no input requiring grad: no backward, no optimizer step, no
    training peak (eager loss.backward() raises); a warning says so instead of a silently missing
    line. An input that requires grad makes a backward again."""
    (tmp_path / "frozen.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Frozen(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.l = nn.Linear(8, 4).requires_grad_(False)\n\n"
        "    def forward(self, x):\n"
        "        return self.l(x)\n\n"
        "    def example_inputs(self, batch):\n"
        "        return (torch.randn(batch, 8),)\n")
    model = str(tmp_path / "frozen.py") + ":Frozen"
    doc = json.loads(invoke("profile", model, "--batch", "2", "--format", "json").stdout)
    assert doc["memory"]["peak_train"] is None and any("nothing trains" in w for w in doc["warnings"])
    doc = json.loads(invoke("profile", model, "--batch", "2", "--input-requires-grad", "--format", "json").stdout)
    assert doc["memory"]["peak_train"] is not None and not any("nothing trains" in w for w in doc["warnings"])
    # on a GPU its fit is its inference peak, as check's memory budget is (both were exit 4), and
    # the largest-batch search, of a training step, is not run; plan, of training layouts, refuses it
    gpu = json.loads(invoke("profile", model, "--batch", "2", "--gpu", "h100", "--format", "json").stdout)
    fit, inference = gpu["memory"]["fit"], gpu["memory"]["peak_inference"]["bytes"]
    assert (fit["basis"], fit["peak_bytes"], fit["max_batch"]) == ("peak_inference_bytes", inference, None), fit
    assert fit["headroom_bytes"] == fit["capacity_bytes"] - inference
    check = json.loads(invoke("check", model, "--batch", "2", "--gpu", "h100", "--format", "json").stdout)
    assert [(b["figure"], b["value"]) for b in check["budgets"]] == [("peak_inference_bytes per rank", inference)]
    assert_one_line_error(invoke("plan", model, "--gpus", "2", "--gpu", "h100", "--global-batch", "4"), 2,
                          "nothing in the model trains", "fxacct profile --gpu")
    # the real run of a training step would raise in loss.backward() (it did: exit 3); --inference times one
    assert_one_line_error(invoke("profile", model, "--batch", "2", "--runtime", "--steps", "1"), 2,
                          "nothing in the model trains", "give --inference")
    # DDP refuses a module of which nothing trains (torch's constructor raises): said as such, not exit 4
    assert_one_line_error(invoke("profile", model, "--batch", "2", "--mesh", "dp=2"), 2,
                          "--mesh dp=2 is DDP", "nothing trains", "--mesh fsdp=N")


def test_a_plain_dataclass_output_is_opened_field_by_field(tmp_path):
    """pytree does not know a plain @dataclass: its tensors were not seen ("no floating-point
    tensor"). Linear(8, 4) on batch 2: 2·2·8·4 = 128 matmul + 8 bias adds, then relu 8: forward 144;
    the default loss sums both fields, and --loss-output 1 picks the second."""
    (tmp_path / "dc.py").write_text(
        "import dataclasses\nimport torch\nfrom torch import nn\n\n"
        "@dataclasses.dataclass\nclass Out:\n    logits: torch.Tensor\n    hidden: torch.Tensor\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(8, 4)\n\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        return Out(h, h.relu())\n\n"
        "    def example_inputs(self, batch):\n"
        "        return (torch.randn(batch, 8),)\n")
    for extra in ([], ["--loss-output", "1"]):
        result = invoke("profile", str(tmp_path / "dc.py") + ":Net", "--batch", "2", "--format", "json", *extra)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["totals"]["forward_flops"] == 144


def test_a_constructor_reading_tensor_values_is_built_on_the_cpu(tmp_path):
    """Widths from tensor math and .tolist() (torchvision's RegNet does this) cannot be read on the
    meta device: the model is built on the CPU instead, and profiles. Linear(4, 8), (8, 16),
    (16, 24): 4·8 + 8 + 8·16 + 16 + 16·24 + 24 = 592 parameters."""
    (tmp_path / "widths.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        widths = (torch.arange(1, 4) * 8.0).round().int().tolist()\n"
        "        self.layers = nn.Sequential(*[nn.Linear(a, b) for a, b in zip([4] + widths[:-1], widths)])\n\n"
        "    def forward(self, x):\n"
        "        return self.layers(x)\n\n"
        "    def example_inputs(self, batch):\n"
        "        return (torch.randn(batch, 4),)\n")
    result = invoke("profile", str(tmp_path / "widths.py") + ":Net", "--batch", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["totals"]["params"] == 592


@pytest.mark.slow  # a whole process per case; test_python_dash_m_fxacct_runs_the_cli stays fast
@pytest.mark.parametrize("args, code", [
    ([f"{MODELS}/forward_raises.py:ForwardRaises"], 3),
    # A shape mismatch fails inside a fake-tensor meta kernel; torch logs its own traceback through
    # `logging` (to the process's real stderr, which CliRunner does not capture), so check a real process.
    ([TWO_LAYER, "--input", "float32[B,5]"], 3),
], ids=["forward-raises", "input-shape-mismatch"])
def test_real_process_prints_one_error_line(args, code):
    proc = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    msg = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == code, msg
    assert "Traceback" not in proc.stderr + proc.stdout, msg
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), msg


@pytest.mark.parametrize("args, fragments", [
    # forward(x) has no parameter y: the --input spec does not match the model (a usage error, exit 2),
    # and the line should name forward's parameters so the user can fix the spec.
    ([TWO_LAYER, "--input", "y=float32[B,3]"], ["'y'", "x"]),
    # Two positional inputs for forward(x).
    ([TWO_LAYER, "--input", "float32[B,3]", "--input", "float32[B,3]"], ["--input", "x"]),
], ids=["input-unknown-keyword", "input-too-many"])
def test_inputs_that_do_not_match_forward_are_usage_errors(args, fragments):
    assert_one_line_error(invoke("profile", *args), 2, *fragments)


# --------------------------------------------------------------------------------------------------
# Whose code raised: the user's (exit 3, naming file:line and the statement) or fxacct's (exit 4)
# --------------------------------------------------------------------------------------------------

def line_of(path: Path, text: str) -> int:
    """The 1-based number of the only line of ``path`` that is the statement ``text``."""
    found = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line.split("#")[0].strip() == text]
    assert len(found) == 1, (path, text, found)
    return found[0]


@pytest.mark.parametrize("target, kwargs, statement", [
    # tests/models/bare_assert.py: `assert n_embd % n_head == 0` with 30 % 4 = 2
    (ROOT / MODELS / "bare_assert.py", ["-k", "n_embd=30"], "assert n_embd % n_head == 0"),
    # nanoGPT's own: n_embd=30 with the default n_head=4
    (ROOT / "examples" / "gpt2.py", ["-k", "n_embd=30"], "assert n_embd % n_head == 0"),
], ids=["fixture", "gpt2"])
def test_bare_assert_in_the_constructor_names_the_failing_line(target, kwargs, statement):
    # A bare assert has no message: "raised AssertionError" alone tells the user nothing. The line
    # names the file, the line and the failed condition.
    name = {"bare_assert.py": "BareAssert", "gpt2.py": "GPT"}[target.name]
    line = assert_one_line_error(invoke("profile", f"{target}:{name}", *kwargs), 3, name, "AssertionError")
    assert f"{target.name}:{line_of(target, statement)}: {statement}" in line, line


def test_forward_raising_in_the_users_file_names_file_line_and_statement():
    target = ROOT / MODELS / "forward_raises.py"
    statement = 'raise RuntimeError("forward is broken on purpose")'
    line = assert_one_line_error(invoke("profile", f"{target}:ForwardRaises"), 3, "forward is broken on purpose")
    assert f"forward_raises.py:{line_of(target, statement)}: {statement}" in line, line


@pytest.mark.parametrize("args, fragments", [
    # nn.Sequential(Linear(3, 4), ...) fed 5 features: the error is raised inside torch's Linear,
    # reached from fxacct's call of the model, with no frame of the model file in between
    (["make_sequential"], ["the model's forward", "torch/nn/modules/linear.py", "F.linear"]),
    # `Linear = nn.Linear` in the model file, built with in_features=-1: torch's constructor raises
    (["Linear", "-k", "in_features=-1", "-k", "out_features=2"], ["Linear(in_features=-1", "negative dimension"]),
], ids=["sequential-shape", "torch-constructor"])
def test_a_model_made_of_torch_modules_fails_as_the_model(args, fragments):
    target = f"{ROOT / MODELS / 'torch_only.py'}:{args[0]}"
    assert_one_line_error(invoke("profile", target, *args[1:]), 3, *fragments)


def test_a_bug_in_fxacct_during_the_trace_is_an_internal_error(monkeypatch):
    # A KeyError raised by fxacct's own recorder while it traces the backward: the model is fine
    # (examples/two_layer.py profiles cleanly), so this is fxacct's bug, exit 4, never "the model's
    # backward raised KeyError" (exit 3). dict.popitem on an empty dict raises KeyError from C, so
    # the innermost Python frame is fxacct's own __torch_dispatch__.
    from fxacct.trace import torch_private

    monkeypatch.setattr(torch_private, "current_autograd_number", {}.popitem)
    line = assert_one_line_error(invoke("profile", f"{ROOT}/examples/two_layer.py:TwoLayer"), 4,
                                 "internal error", "KeyError", "--debug")
    assert "dispatch_recorder.py" in line and "during the model's backward" in line, line
    assert "raised" not in line, line
    result = invoke("profile", f"{ROOT}/examples/two_layer.py:TwoLayer", "--debug")
    last = result.stderr.splitlines()[-1]
    assert result.exit_code == 4 and "Traceback" in result.stderr and "KeyError" in last, result.stderr
    assert last.endswith("; report it with the traceback above") and "--debug" not in last, last


def test_torch_calling_an_fxacct_hook_wrongly_inside_the_forward_is_an_internal_error(tmp_path, monkeypatch):
    # A torch release that calls one of fxacct's callbacks with other arguments (as torch 2.15 calls
    # FSDP2's copy-out with all_gather_output_fn=) raises a TypeError at torch's call site, with no
    # fxacct frame, from inside the model's forward. Here torch calls fxacct's global forward hook
    # with the module's kwargs as well (with_kwargs=True: hook(module, args, kwargs, output)); the
    # model is fine, so it is exit 4 naming fxacct's hook, never "the model's forward raised" (3).
    import torch

    model = tmp_path / "nested.py"
    model.write_text("import torch\nfrom torch import nn\n\n"
                     "class Nested(nn.Module):\n"
                     "    def __init__(self):\n"
                     "        super().__init__()\n"
                     "        self.inner = nn.Linear(3, 2)\n\n"
                     "    def forward(self, x):\n"
                     "        return self.inner(x).relu()\n\n"
                     "    def example_inputs(self, batch):\n"
                     "        return (torch.randn(batch, 3),)\n")
    assert invoke("profile", f"{model}:Nested").exit_code == 0  # the model itself profiles cleanly
    register = torch.nn.modules.module.register_module_forward_hook
    monkeypatch.setattr(torch.nn.modules.module, "register_module_forward_hook",
                        lambda hook, **kw: register(hook, **{**kw, "with_kwargs": True}))
    line = assert_one_line_error(invoke("profile", f"{model}:Nested"), 4, "internal error", "TypeError",
                                 "post() takes 3 positional arguments but 4 were given", "torch/nn/modules/module.py")
    assert "the model's forward raised" not in line and "nested.py" not in line, line


def test_a_bug_in_a_cost_formula_is_an_internal_error(monkeypatch):
    from fxacct.account import annotate
    from fxacct.costs.registry import OpInfo

    def broken_formula(*args, **kwargs):
        return {}["no such key"]

    monkeypatch.setattr(annotate, "lookup", lambda op: OpInfo(broken_formula))
    assert_one_line_error(invoke("profile", f"{ROOT}/examples/two_layer.py:TwoLayer"), 4,
                          "internal error", "'no such key'", "--debug")


def test_the_real_run_failing_in_the_users_file_is_a_model_error():
    # traces on fake tensors, raises on real ones: the failure comes from the runtime path
    target = ROOT / MODELS / "runtime_raises.py"
    statement = 'raise ValueError("real tensors are refused on purpose")'
    line = assert_one_line_error(invoke("profile", f"{target}:RuntimeRaises", "--runtime", "--device", "cpu",
                                        "--steps", "1", "--warmup", "0"), 3, "the real run", "ValueError")
    assert f"runtime_raises.py:{line_of(target, statement)}: {statement}" in line, line


def test_the_memory_refusal_exits_as_the_help_says(monkeypatch):
    from fxacct.runtime import setup

    monkeypatch.setattr(setup, "free_bytes", lambda device: 1)  # one free byte: any model is refused
    result = invoke("profile", f"{ROOT}/examples/two_layer.py:TwoLayer", "--runtime", "--device", "cpu")
    assert_one_line_error(result, 3, "exceeds the free memory", "--force")
    help_text = " ".join(invoke("profile", "--help").stdout.split())
    assert "3 the model failed (its constructor or forward raised, or --runtime refused" in help_text, help_text


# --------------------------------------------------------------------------------------------------
# Output files
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/proc/x.json", "/nonexistent_fxacct_dir/x.json"])
def test_unwritable_output_is_a_usage_error_before_any_work(path):
    # The model's forward raises: exit 2, not 3, shows the path is refused before the trace runs.
    line = assert_one_line_error(invoke("profile", f"{ROOT / MODELS}/forward_raises.py:ForwardRaises", "-o", path),
                                 2, f"cannot write {path}")
    assert "internal error" not in line, line


def test_unwritable_output_of_the_mlp_is_one_line():
    assert_one_line_error(invoke("profile", f"{ROOT}/examples/mlp.py:MLP", "-o", "/proc/x.json"), 2, "/proc/x.json")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_output_files_get_the_mode_open_would_give(tmp_path, umask, mode):
    # open(path, "w") creates files 0o666 & ~umask; an atomic write through mkstemp would give 0o600
    old = os.umask(umask)
    try:
        profile(f"{ROOT}/examples/two_layer.py:TwoLayer", "--format", "json", "-o", str(tmp_path / "out.json"))
        plain = tmp_path / "plain.txt"
        with open(plain, "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == mode == plain.stat().st_mode & 0o777
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "plain.txt"]  # no temporary left


def test_output_through_a_symbolic_link_writes_its_target_and_keeps_the_link(tmp_path):
    # the atomic write's rename replaced the link itself with a regular file, the target left as it was
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    profile(f"{ROOT}/examples/two_layer.py:TwoLayer", "--format", "json", "-o", str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["model_class"] == "TwoLayer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]  # no temporary left


def test_output_to_a_named_pipe_is_written_in_place(tmp_path):
    # as /dev/null is: the atomic write's rename put a regular file where the pipe (as root: the device) was
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    profile(f"{ROOT}/examples/two_layer.py:TwoLayer", "--format", "json", "-o", str(fifo))
    reader.join(timeout=60)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert got and json.loads(got[0])["model_class"] == "TwoLayer"


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_what_the_model_prints_goes_to_stderr_and_stdout_keeps_the_report_alone(tmp_path, fmt):
    # the model's own prints (at import and in forward) led stdout, before the document: json.load failed
    path = tmp_path / "printy.py"
    path.write_text("import torch\nprint('hello from import')\n"
                    "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.lin = torch.nn.Linear(4, 4)\n"
                    "    def forward(self, x):\n        print('in forward')\n        return self.lin(x)\n")
    result = profile(f"{path}:M", "--input", "float[B,4]", "--format", fmt)
    if fmt == "json":
        assert json.loads(result.stdout)["model_class"] == "M"
    else:
        assert result.stdout.startswith("name,op,module,"), result.stdout[:200]
    assert "hello from import" not in result.stdout and "in forward" not in result.stdout
    assert "hello from import" in result.stderr and "in forward" in result.stderr


def test_an_empty_output_path_is_one_line():
    assert_one_line_error(invoke("profile", TWO_LAYER, "-o", ""), 2, "output path is empty", "profile.json")


# --------------------------------------------------------------------------------------------------
# The library and its CLI
# --------------------------------------------------------------------------------------------------

def test_the_library_never_imports_the_cli():
    offenders = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                 for p in sorted((ROOT / "fxacct").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if line.lstrip().startswith(("import fxacct_cli", "from fxacct_cli"))]
    assert offenders == []
    code = ("import importlib, pkgutil, sys, fxacct\n"
            "for m in pkgutil.walk_packages(fxacct.__path__, 'fxacct.'):\n"
            "    if not m.name.endswith('__main__'):\n"
            "        importlib.import_module(m.name)\n"
            "assert 'fxacct_cli' not in sys.modules, sorted(n for n in sys.modules if 'fxacct' in n)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_python_dash_m_fxacct_runs_the_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fxacct", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Usage:") and "profile" in proc.stdout, proc.stdout


@pytest.mark.parametrize("mesh", [(), ("--mesh", "fsdp=1")])
def test_input_requires_grad_on_integer_inputs_says_it_changes_nothing(mesh):
    """Token ids have no gradient: --input-requires-grad on a model whose every input is an integer
    tensor leaves the account as it was (it was silent); a warning says so, on one device and under a
    mesh alike. A floating-point input takes the flag (dInput joins the backward) and gets no warning."""
    plain = profile_json(*TINY_GPT, *mesh)
    flagged = profile_json(*TINY_GPT, "--input-requires-grad", *mesh)
    assert flagged["totals"] == plain["totals"]
    said = [w for w in flagged["warnings"] if "--input-requires-grad changes nothing" in w]
    assert len(said) == 1 and "(int64)" in said[0], flagged["warnings"]
    assert not any("--input-requires-grad" in w for w in plain["warnings"])
    floats = profile_json(TWO_LAYER, "--batch", "2", "--input-requires-grad", *mesh)
    assert floats["totals"]["backward_flops"] > profile_json(TWO_LAYER, "--batch", "2", *mesh)["totals"]["backward_flops"]
    assert not any("--input-requires-grad" in w for w in floats["warnings"])


@pytest.mark.parametrize("mesh", [(), ("--mesh", "fsdp=1")])
def test_count_recompute_with_nothing_recomputed_says_it_changes_nothing(mesh):
    """--count-recompute without checkpointing left the account as it was, silently; a warning says
    so, on one device and under a mesh alike. With --checkpoint it counts and says nothing."""
    plain, flagged = profile_json(*TINY_GPT, *mesh), profile_json(*TINY_GPT, "--count-recompute", *mesh)
    assert flagged["totals"] == plain["totals"]
    assert any(w.startswith("--count-recompute changes nothing") for w in flagged["warnings"]), flagged["warnings"]
    checkpointed = profile_json(*TINY_GPT, "--checkpoint", "h.*", "--count-recompute", *mesh)
    assert checkpointed["totals"]["recompute_flops"] > 0
    assert not any("--count-recompute" in w for w in checkpointed["warnings"])

"""The one-screen summary that opens `fxacct profile`, fitting tables to the terminal's width, and
durations printed with a unit that keeps the number at least 1.

The summary's numbers are checked against the JSON document of the same run (fxacct.report.document:
an independent rendering path); widths are counted in characters."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from helpers import target

import fxacct
from fxacct.report.durations import format_ms
from fxacct.report.width import fit_table, shorten_middle
from fxacct.units import format_count
from fxacct_cli.main import cli

GPT2 = target("examples/gpt2.py:GPT")
TINY_GPT = [GPT2, "-k", "n_layer=1", "-k", "n_embd=32", "-k", "n_head=2", "-k", "block_size=16",
            "-k", "vocab_size=64", "--batch", "2"]
SI = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def run(*args: str, columns: int | None = None) -> str:
    env = {"COLUMNS": str(columns)} if columns else {"COLUMNS": ""}
    result = CliRunner().invoke(cli, ["profile", *args], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def si(text: str) -> float:
    """'2.335T' -> 2.335e12."""
    m = re.fullmatch(r"([\d.,]+)([kMGTP]?)", text)
    return float(m.group(1).replace(",", "")) * SI[m.group(2)]


def line_with(lines: list[str], label: str) -> str:
    """The summary line '  label  text', joined with its wrapped continuation lines."""
    i = next(i for i, line in enumerate(lines) if line.startswith(f"  {label} "))
    parts = [lines[i].strip()]
    for line in lines[i + 1:]:
        if not line.startswith("    "):
            break
        parts.append(line.strip())
    return " ".join(parts)


def test_gpt2_summary_fits_100_columns_and_matches_the_json():
    # The acceptance line of issue 10: COLUMNS=100, no line over 100 characters, and the first 15
    # lines answer FLOPs, parameters, training peak, fit / largest batch, predicted step time.
    args = ("--batch", "8", "--dtype", "bf16", "--gpu", "h100")
    out = run(GPT2, *args, columns=100)
    long = [line for line in out.splitlines() if len(line) > 100]
    assert not long, long
    doc = json.loads(run(GPT2, *args, "--format", "json"))
    t, fit = doc["totals"], doc["memory"]["fit"]
    head = out.splitlines()[:15]
    flops, params, peak = (line_with(head, k) for k in ("FLOPs", "parameters", "peak"))
    fit_line, step = line_with(head, "fit"), line_with(head, "step time")
    # FLOPs: short SI figures, 4 significant digits: within 0.05% of the exact integers
    m = re.search(r"forward (\S+) \+ backward (\S+);", flops)
    assert si(m.group(1)) == pytest.approx(t["forward_flops"], rel=5e-4), flops
    assert si(m.group(2)) == pytest.approx(t["backward_flops"], rel=5e-4), flops
    # per token: (forward + backward) / (batch 8 × 1024 tokens)
    per_token = re.search(r"(\S+) per token", flops).group(1)
    assert si(per_token) == pytest.approx((t["forward_flops"] + t["backward_flops"]) / (8 * 1024), rel=5e-4)
    assert f"({t['params']:,})" in params, params
    assert f"({t['peak_train_bytes']:,} B)" in peak, peak
    top = max(doc["memory"]["peak_train"]["by_category"].items(), key=lambda kv: kv[1])[0]
    assert top.replace("_", " ") in peak, (top, peak)
    assert fit_line.startswith("fit         fits,") and f"largest batch {fit['max_batch']}" in fit_line, fit_line
    # step time: 3 significant digits of the roofline's figure; tokens/s = 8 · 1024 / step
    m = re.search(r"time\s+([\d.]+) ms predicted.*; (\S+) tokens/s", step)
    assert float(m.group(1)) == pytest.approx(t["predicted_step_ms"], rel=5e-3), step
    assert si(m.group(2)) == pytest.approx(8 * 1024 / (t["predicted_step_ms"] / 1e3), rel=5e-4), step


def test_summary_flag_prints_only_the_summary_and_it_opens_the_full_report():
    short = run(*TINY_GPT, "--gpu", "h100", "--no-max-batch", "--summary")
    full = run(*TINY_GPT, "--gpu", "h100", "--no-max-batch")
    assert 5 <= len(short.splitlines()) <= 15, short
    assert full.startswith(short), (short, full)
    assert "uncosted    nothing: every op has a cost formula" in short, short
    assert "top 10 nodes" not in short and "top 10 nodes" in full


def test_tables_fit_the_width_and_wide_shows_everything():
    narrow = run(*TINY_GPT, "--depth", "4", columns=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    wide = run(*TINY_GPT, "--depth", "4", "--wide", columns=80)
    assert any(len(line) > 80 for line in wide.splitlines()), wide
    assert "h.0.attn.c_attn" in wide and "…" not in wide
    # numbers are never cut: every FLOPs figure of the wide node table is in the narrow one
    def node_numbers(text):
        lines = text.split("top 10 nodes")[1].split("\n\n")[0].splitlines()
        i = lines[1].split().index("forward")  # the text columns before it hold no spaces
        return [r.split()[i:i + 2] for r in lines[3:]]
    assert [r for r in node_numbers(narrow)] == [r for r in node_numbers(wide)], (narrow, wide)


def test_no_columns_and_no_terminal_means_no_limit():
    out = run(*TINY_GPT, "--depth", "4")  # CliRunner's stdout is not a terminal
    assert "…" not in out and any(len(line) > 100 for line in out.splitlines())


def test_fit_table_shortens_text_in_the_middle_and_never_cuts_numbers():
    path = "model.transformer.layers.11.self_attention.query_key_value"
    rows = [[path, "1,234,567,890,123", "98.76 MiB"], ["(root)", "2,469,135,780,246", "1.50 GiB"]]
    text = fit_table(["module", "FLOPs", "activations"], rows, 50, text_columns=(0,))
    assert max(len(line) for line in text.splitlines()) <= 50, text
    assert "1,234,567,890,123" in text and "2,469,135,780,246" in text and "98.76 MiB" in text, text
    short = text.splitlines()[2].split()[0]
    assert "…" in short and short.startswith("model.tr") and short.endswith("y_value"), short
    assert short == "model.tr…y_value"  # 50 - 2·2 spaces - 17 - 11 (numbers) = 16 characters left
    assert len(shorten_middle(path, 16)) == 16 and shorten_middle("short", 16) == "short"
    # too narrow for the text alone: the optional column goes before the path drops under 20
    dropped = fit_table(["module", "FLOPs", "activations"], rows, 42, text_columns=(0,), optional=(2,))
    assert "activations" not in dropped and "1,234,567,890,123" in dropped, dropped
    assert max(len(line) for line in dropped.splitlines()) <= 42, dropped


@pytest.mark.parametrize("ms, text", [
    (0.00481e-3, "4.81 ns"),  # 4.81e-9 s: was "0.00481 µs"
    (0.5e-3, "500 ns"), (0.0123, "12.3 µs"), (1.0, "1 ms"), (12.74, "12.7 ms"), (999, "999 ms"),
    (44_100, "44.1 s"), (0, "0 s"), (None, "-"),
    (60_000, "1 min"), (0.0238 * 86_400e3, "34.3 min"),  # 0.0238 days = 34.27 min
    (2.99 * 3.6e6, "2.99 h"), (3 * 86_400e3, "3 days"),
    (239.9 * 86_400e3, "8 months"),  # 239.9 / 30 = 7.997 (30-day months)
    (1e4 * 86_400e3, "27.4 years"),  # 10,000 / 365 = 27.40
])
def test_durations_pick_the_unit_that_keeps_the_number_at_least_1(ms, text):
    assert format_ms(ms) == text


@pytest.mark.parametrize("args, flag", [(("--summary", "--format", "json"), "--summary"),
                                        (("--summary", "--format", "csv"), "--summary"),
                                        (("--wide", "--format", "markdown"), "--wide")])
def test_layout_flags_elsewhere_are_refused_not_ignored(args, flag):
    result = CliRunner().invoke(cli, ["profile", target("examples/two_layer.py:TwoLayer"), *args],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and flag in line and f"drop {flag}" in line, line


def test_runtime_tables_fit_the_width_too():
    out = run(*TINY_GPT, "--runtime", "--device", "cpu", "--steps", "1", "--warmup", "0", columns=80)
    assert "runtime on cpu" in out and "measured/predicted" in out, out
    assert max(len(line) for line in out.splitlines()) <= 80, out


def test_warnings_reach_every_output():
    """A warning that makes the numbers less than exact (fp8 matmuls, which no kernel runs) is in
    the summary alone (--summary), in the full report once, and on stderr beside a JSON document,
    which carries it under "warnings"."""
    args = [*TINY_GPT, "--dtype", "fp8"]
    summary = run(*args, "--summary")
    assert summary.count("WARNING: ") == 1 and "take float8 tensors" in summary
    assert run(*args).count("WARNING: ") == 1
    result = CliRunner().invoke(cli, ["profile", *args, "--format", "json"], env={"COLUMNS": ""})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert len(doc["warnings"]) == 1
    assert result.stderr.strip() == f"warning: {doc['warnings'][0]}"
    plain = CliRunner().invoke(cli, ["profile", *TINY_GPT, "--format", "json"], env={"COLUMNS": ""})
    assert json.loads(plain.stdout)["warnings"] == [] and plain.stderr == ""


def test_config_line_names_the_sequence_length_and_the_loss():
    lines = run(*TINY_GPT, "--summary").splitlines()
    # tiny GPT: block_size 16 tokens per example (its example_inputs are long[B,16])
    assert line_with(lines, "config") == "config      batch 2, sequence 16, model dtypes, adamw, loss sum"
    lines = run(*TINY_GPT, "--loss", "cross-entropy", "--summary").splitlines()
    assert line_with(lines, "config").endswith(", loss cross-entropy")


def test_mesh_parameters_are_labelled_per_rank_beside_the_whole_model():
    from helpers import load

    llama, par = target("examples/llama.py:Llama"), target("examples/llama.py:parallelize")
    args = (llama, "--batch", "2", "--mesh", "fsdp=2,tp=2", "--parallelize", par)
    whole = sum(p.numel() for p in load(fxacct.Config(target=llama))[0].parameters())
    rank0 = json.loads(run(*args, "--format", "json"))["totals"]["params"]
    assert rank0 < whole  # rank 0 holds a shard
    lines = run(*args, "--summary").splitlines()
    params = line_with(lines, "parameters")
    assert params.startswith(f"parameters  per rank (rank 0's shard) {format_count(rank0)} ({rank0:,})"), params
    assert params.endswith(f"the whole model {format_count(whole)} ({whole:,})"), params
    assert "per rank, mesh fsdp=2,tp=2" in line_with(lines, "config")
    md = run(*args, "--format", "markdown")
    assert "| parameters (per rank)" in md and "| training peak per rank" in md
    row = next(line for line in md.splitlines() if line.startswith("| parameters (the whole model)"))
    assert row.split("|")[2].strip() == f"{whole:,}"


def test_a_model_far_too_large_is_short_by_pib_and_its_step_takes_hours():
    # one 2^24 × 2^24 linear layer twice (MLP, d_model = d_hidden = 2^24): 2 · (2^48 + 2^24) + 2^24 + ... ≈ 5.6e14
    # parameters, so about 10 PiB at the AdamW peak against an H100's 79.65 GiB
    args = (target("examples/mlp.py:MLP"), "-k", "d_model=16777216", "-k", "d_hidden=16777216", "-k", "n_blocks=1",
            "--gpu", "h100", "--no-max-batch")
    doc = json.loads(run(*args, "--format", "json"))
    short, ms = -doc["memory"]["fit"]["headroom_bytes"], doc["totals"]["predicted_step_ms"]
    assert 2**53 < short < 2**60 and 3.6e6 < ms < 86.4e6  # PiB short; between an hour and a day
    lines = run(*args, "--summary").splitlines()
    assert line_with(lines, "fit").startswith(f"fit         DOES NOT FIT, {short / 2**50:.2f} PiB short of 79.65 GiB on")
    assert line_with(lines, "step time").startswith(f"step time   {ms / 3.6e6:.3g} h predicted")
    full = run(*args)
    # the fit on a CUDA target holds reserved + fixed (memory.fit.basis), >= the op-level peak
    fit = doc["memory"]["fit"]
    assert fit["basis"] == "peak_reserved_bytes + fixed" and fit["peak_bytes"] >= doc["totals"]["peak_train_bytes"]
    assert f"per-rank peak reserved + fixed {fit['peak_bytes'] / 2**50:.2f} PiB, DOES NOT FIT, " in full, full


def test_a_profile_shows_its_headline_in_a_notebook():
    """repr and _repr_html_ (what a notebook shows): the two-layer model's forward 2·2·3·3 + 2·2·3·2 =
    60 FLOPs, backward 84 (x needs no gradient: 120 − 36), 3·3 + 3·2 = 15 parameters; under a mesh
    the figures say per rank."""
    import fxacct

    p = fxacct.profile(fxacct.Config(target="examples/two_layer.py:TwoLayer", batch=2))
    text = repr(p)
    assert text.startswith("<fxacct.Profile examples/two_layer.py:TwoLayer:") and "60 + 84" in text
    assert "parameters 15;" in text and "per rank" not in text
    page = p._repr_html_()
    assert "<td>60 + 84</td>" in page and "<td>15</td>" in page
    mesh = fxacct.profile(fxacct.Config(target="examples/two_layer.py:TwoLayer", batch=2, mesh="fsdp=2"))
    assert "parameters per rank" in repr(mesh) and "mesh fsdp=2" in repr(mesh)

"""`--format markdown` of profile and diff, parsed with markdown-it-py (CommonMark plus GitHub's
pipe tables): the tables render as tables with the expected rows and columns, the verdict of the
budgets comes first, and the figures carry thousands separators."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import target

from fxacct_cli.main import cli

markdown_it = pytest.importorskip("markdown_it")

TWO_LAYER = target("examples/two_layer.py:TwoLayer")
TINY_GPT = [target("examples/gpt2.py:GPT"), "-k", "n_layer=1", "-k", "n_embd=32", "-k", "n_head=2",
            "-k", "block_size=16", "-k", "vocab_size=64", "--batch", "2"]


def invoke(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.stdout


def plain(inline) -> str:
    """The text an inline token renders to (code spans and emphasis unwrapped)."""
    return "".join(c.content for c in inline.children or () if c.type in ("text", "code_inline"))


def blocks(text: str) -> list:
    """The document as a list of ('paragraph', text), ('heading', text) and ('table', [[cells]...])
    in order, from markdown-it-py's token stream (list items are skipped)."""
    tokens = markdown_it.MarkdownIt("commonmark").enable("table").parse(text)
    out, row, in_list = [], None, 0
    for i, t in enumerate(tokens):
        in_list += {"bullet_list_open": 1, "bullet_list_close": -1}.get(t.type, 0)
        if t.type == "table_open":
            out.append(("table", []))
        elif t.type == "tr_open":
            row = []
        elif t.type == "tr_close":
            out[-1][1].append(row)
        elif t.type in ("th_open", "td_open"):
            row.append(plain(tokens[i + 1]))
        elif t.type in ("paragraph_open", "heading_open") and not in_list:
            out.append((t.type.removesuffix("_open"), plain(tokens[i + 1])))
    return out


def tables(text: str) -> list[list[list[str]]]:
    return [b[1] for b in blocks(text) if b[0] == "table"]


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    d = tmp_path_factory.mktemp("md")
    for batch in (2, 4):
        invoke("profile", TWO_LAYER, "--batch", str(batch), "--format", "json", "-o", str(d / f"b{batch}.json"))
    return d / "b2.json", d / "b4.json"


def test_diff_markdown_is_a_verdict_then_change_tables(profiles):
    old, new = map(str, profiles)
    text = invoke("diff", old, new, "--max-increase", "flops=5%", "--max-increase", "params=0%",
                  "--format", "markdown", code=1)
    parsed = blocks(text)
    assert parsed[0][0] == "paragraph" and "FAILED" in parsed[0][1] and "flops" in parsed[0][1], parsed[0]
    budgets, totals, modules = tables(text)
    assert budgets[0] == ["budget", "before", "after", "Δ", "%", "allowed", "status"], budgets
    # TwoLayer forward + backward = 144 FLOPs at B=2 and 288 at B=4 (linear in B): +144, +100%
    assert budgets[1] == ["flops", "144", "288", "+144", "+100.00%", "+5%", "OVER"], budgets
    assert budgets[2][:5] == ["params", "15", "15", "0", "+0.00%"] and budgets[2][-1] == "ok", budgets
    assert totals[0] == ["total", "before", "after", "Δ", "%"], totals
    diff_doc = json.loads(invoke("diff", old, new, "--format", "json"))
    assert [r[0] for r in totals[1:]] == [c["key"] for c in diff_doc["totals"]], totals
    assert all(len(r) == 5 for r in totals), totals
    forward = next(r for r in totals if r[0] == "forward_flops")
    assert forward == ["forward_flops", "60", "120", "+60", "+100.00%"], forward
    assert modules[0][:2] == ["module", "status"] and modules[1][0] == "(root)", modules


def test_diff_markdown_says_ok_when_budgets_hold(profiles):
    text = invoke("diff", *map(str, profiles), "--max-increase", "flops=150%", "--format", "markdown")
    first = blocks(text)[0]
    assert first[0] == "paragraph" and "ok" in first[1] and "all 1 budget(s) hold" in first[1], first


def test_profile_markdown_has_summary_totals_and_modules_with_separators():
    text = invoke("profile", *TINY_GPT, "--format", "markdown")
    doc = json.loads(invoke("profile", *TINY_GPT, "--format", "json"))
    totals, modules = tables(text)
    values = dict(totals[1:])
    t = doc["totals"]
    assert values["forward FLOPs"] == f"{t['forward_flops']:,}", values  # e.g. 1,021,440
    assert values["parameters"] == "15,328", values  # tests/test_cli.py TINY_GPT: 15,328 by hand
    assert values["training peak"].endswith(f"({t['peak_train_bytes']:,} B)"), values
    assert modules[0] == ["module", "forward FLOPs", "backward FLOPs", "share", "activations"], modules
    # the table's default depth, 2 (as the text table's): h.0 is shown, h.0.attn (depth 3) is not
    shown = [m["module"] or "(root)" for m in doc["modules"] if not m["module"] or m["module"].count(".") + 1 <= 2]
    assert [r[0] for r in modules[1:]] == shown and "h.0" in shown, modules
    lm_head = next(r for r in modules if r[0] == "lm_head")
    assert lm_head[1] == "131,072", lm_head  # 2·(B·T = 32)·32·64
    assert "**FLOPs**" in text and "**peak**" in text, text  # the summary, as a list above the tables


def test_profile_markdown_summary_only():
    text = invoke("profile", *TINY_GPT, "--format", "markdown", "--summary")
    assert tables(text) == [] and "**parameters**: 15.328k (15,328)" in text, text


def test_profile_markdown_depth_limits_the_modules():
    text = invoke("profile", *TINY_GPT, "--format", "markdown", "--depth", "1")
    modules = tables(text)[1]
    # depth 1 of the tiny GPT: the root and its five children wte, wpe, h, ln_f, lm_head
    assert [r[0] for r in modules[1:]] == ["(root)", "wte", "wpe", "h", "ln_f", "lm_head"], modules

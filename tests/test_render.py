"""fxacct.report.render: the one way to a whole report, from Python and from `fxacct profile --format`
(the CLI calls it, so each format's output is the same string both ways), and the markdown module
table keeps the --depth default of the text table (2)."""

import json
import re

import pytest
from click.testing import CliRunner
from helpers import load, target

import fxacct
from fxacct.errors import UsageError
from fxacct.report import render
from fxacct_cli.main import cli

TWO_LAYER = "examples/two_layer.py:TwoLayer"
TINY_GPT = ["examples/gpt2.py:GPT", "-k", "n_layer=1", "-k", "n_embd=32", "-k", "n_head=2",
            "-k", "block_size=16", "-k", "vocab_size=64"]
GPT_KWARGS = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64)


def cli_text(*args) -> str:
    r = CliRunner().invoke(cli, ["profile", *args], env={"COLUMNS": ""}, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.fixture(scope="module")
def two_layer():
    return fxacct.profile(fxacct.Config(target=TWO_LAYER, batch=2))


@pytest.mark.parametrize("fmt", ["table", "json", "csv", "markdown", "html"])
def test_render_is_what_the_cli_writes(two_layer, fmt):
    assert render(two_layer, fmt) == cli_text(TWO_LAYER, "--batch", "2", "--format", fmt)


def test_render_text_is_the_table_and_json_holds_the_numbers(two_layer):
    assert render(two_layer) == render(two_layer, "table")
    doc = json.loads(render(two_layer, "json"))
    # x @ w1 @ w2, B=2, D=H=3, K=2: forward 2·B·(D·H + H·K) = 2·2·(9 + 6) = 60, backward: dW only, 2× ... of
    # which dX of the first product is not needed (x needs no gradient): 2·B·D·H + 2·(2·B·H·K) = 36 + 48
    assert doc["totals"]["forward_flops"] == 60
    assert doc["totals"]["backward_flops"] == 2 * 2 * 3 * 3 + 2 * (2 * 2 * 3 * 2) == 84
    assert doc["totals"]["params"] == 15


def test_render_refuses_an_unknown_format_in_one_line(two_layer):
    with pytest.raises(UsageError, match=r"^unknown report format 'pdf': use one of text, json, csv, markdown, html$"):
        render(two_layer, "pdf")


def test_markdown_keeps_the_default_depth_of_the_table():
    model = load(fxacct.Config(target="examples/gpt2.py:GPT", kwargs=GPT_KWARGS))[0]
    # depth = dots + 1 ("" is the root, depth 0): h.0 is depth 2, h.0.attn 3, h.0.attn.c_attn 4
    names = {n for n, _ in model.named_modules()}
    assert {"h.0", "h.0.attn", "h.0.attn.c_attn"} <= names
    text = cli_text(*TINY_GPT, "--format", "markdown")
    section = text.split("#### Modules (depth 2, inclusive)")[1]
    rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| module")]
    assert "h.0" in rows and rows[0] == "(root)"
    assert all(r == "(root)" or (r in names and r.count(".") + 1 <= 2) for r in rows), rows
    deeper = cli_text(*TINY_GPT, "--format", "markdown", "--depth", "9")
    assert "#### Modules (depth 9, inclusive)" in deeper and "`h.0.attn.c_attn`" in deeper


@pytest.mark.parametrize("fmt, options, words", [
    ("csv", dict(by="layer"), "by='layer': give 'node' or 'module'"),
    ("text", dict(by="node"), "by='node' chooses the rows of csv or markdown"),
    ("text", dict(depth="2"), "depth='2': give a whole number"),
    ("text", dict(top=-1), "top=-1: give a whole number"),
    ("json", dict(depth=1), "depth shapes the text and markdown report"),
    ("markdown", dict(top=3), "top shapes the text report"),
    ("json", dict(summary_only=True), "summary_only shortens the text or markdown report"),
])
def test_render_refuses_layout_options_it_would_ignore_or_trip_on(fmt, options, words):
    """render's layout options refused as the CLI refuses its flags: of the wrong kind (a TypeError
    deep in the table code) or for a format they do nothing to (silently ignored)."""
    p = fxacct.profile(fxacct.Config(target=target("examples/two_layer.py:TwoLayer"), batch=2))
    with pytest.raises(UsageError, match=re.escape(words)):
        render(p, fmt, **options)
    assert render(p, "csv", by="module") != render(p, "csv", by="node")
    assert "TwoLayer" in render(p, "markdown", by="node", depth=1, summary_only=True)

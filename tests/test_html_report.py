"""`fxacct profile --format html`: one self-contained page, checked in a real headless browser.

The page is written by the CLI for a small GPT-2 (2 layers) and compared with the `--format json`
report of the same run: the treemap's areas against the module FLOPs and activation bytes, the
timeline's peak against `memory.peak_train`, the node table's order against the node FLOPs.

The browser is Debian's chromium driven by Playwright (never `playwright install`: it downloads a
browser). Without chromium or the playwright package these tests skip, naming what is missing; under
CI=true they fail instead (.ci/run installs chromium).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner
from helpers import ROOT, SMALL_EXAMPLES, target

from fxacct.report.html import _script_json
from fxacct_cli.main import cli

CHROMIUM = os.environ.get("FXACCT_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run"]
GPT_TARGET, GPT_KWARGS = SMALL_EXAMPLES["GPT"]
GPT = [target(GPT_TARGET), *(a for k, v in GPT_KWARGS.items() for a in ("-k", f"{k}={v}")), "--batch", "2"]
MLP_TARGET, MLP_KWARGS = SMALL_EXAMPLES["MLP"]
MLP = [target(MLP_TARGET), *(a for k, v in MLP_KWARGS.items() for a in ("-k", f"{k}={v}")), "--batch", "2"]


def _profile(tmp: Path, name: str, args: list[str], fmt: str) -> Path:
    out = tmp / f"{name}.{fmt}"
    result = CliRunner().invoke(cli, ["profile", *args, "--format", fmt, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _embedded(page_text: str) -> dict:
    m = re.search(r'<script type="application/json" id="fxacct-data">(.*?)</script>', page_text, re.S)
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """(the HTML file, the JSON document) of one small GPT-2, both from the CLI."""
    tmp = tmp_path_factory.mktemp("html")
    page, doc = _profile(tmp, "gpt", GPT, "html"), json.loads(_profile(tmp, "gpt", GPT, "json").read_text())
    return page, doc


# ---- the file itself (no browser needed)

def test_page_embeds_the_json_report_and_fetches_nothing(gpt):
    page, doc = gpt
    text = page.read_text()
    data = _embedded(text)
    timeline = data.pop("timeline")
    assert data == doc  # the same figures as --format json, plus the timeline
    # No network when viewed: nothing refers to a URL but the SVG namespace; a CSP forbids requests.
    assert set(re.findall(r"https?://[^\s\"')]+", text)) == {"http://www.w3.org/2000/svg"}
    assert "default-src 'none'" in text and not re.search(r"<(script|link|img)[^>]+(src|href)=\"(?!data:)", text)
    # The timeline is plot.py's data: its highest point is the reported training peak, one item per op.
    peak = doc["memory"]["peak_train"]
    totals = [sum(row) for row in timeline["bytes"]]
    assert timeline["peak"]["node"] == peak["node"] and max(totals) == peak["bytes"] == doc["totals"]["peak_train_bytes"]
    assert totals.index(max(totals)) == timeline["peak"]["index"]
    assert len(timeline["names"]) == len(timeline["phases"]) == len(timeline["modules"]) == len(totals)


def test_embedded_json_cannot_end_its_script_element():
    hostile = {"module": "</script><script>alert(1)</script><!-- & >"}
    text = _script_json(hostile)
    assert "<" not in text and ">" not in text and json.loads(text) == hostile


def test_assets_are_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data["fxacct.report"] == ["assets/*"]
    assets = {p.name for p in (ROOT / "fxacct" / "report" / "assets").iterdir()}
    assert {"report.html", "report.css", "report.js"} <= assets


# ---- in the browser

def _require_browser() -> None:
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"chromium at {CHROMIUM} (apt-get install chromium)")
    if not missing:
        return
    reason = "the HTML report's browser test needs " + " and ".join(missing)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; under CI it must run (.ci/run installs chromium)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)
        yield b
        b.close()


class Page:
    """A loaded report, with every console message, page error and request it produced."""

    def __init__(self, browser, path: Path):
        self.messages, self.errors, self.requests = [], [], []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console", lambda m: self.messages.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=15_000)

    def cells(self) -> dict[str, float]:
        """Area of each top-level treemap rectangle, by module ('+own' for the module's own ops)."""
        rects = self.page.eval_on_selector_all("#treemap g.cell-g", """gs => gs.map(g => {
            const b = g.querySelector('rect.cell').getBBox();
            return [g.dataset.module + (g.dataset.own ? '+own' : ''), b.width * b.height]; })""")
        return dict(rects)


@pytest.fixture(scope="module")
def gpt_page(browser, gpt):
    page = Page(browser, gpt[0])
    yield page
    page.page.close()


def _expected_cells(doc: dict, parent: str, key) -> dict[str, int]:
    """The JSON's modules directly under ``parent`` with their figure, and the parent's own share."""
    values = {m["module"]: key(m) for m in doc["modules"]}
    prefix = f"{parent}." if parent else ""
    children = {fqn: v for fqn, v in values.items()
                if fqn.startswith(prefix) and fqn != parent and "." not in fqn[len(prefix):] and v > 0}
    own = values[parent] - sum(children.values())
    return {**children, **({f"{parent}+own": own} if own > 0 else {})}


def _assert_proportional(areas: dict[str, float], expected: dict[str, int]) -> None:
    assert set(areas) == set(expected)
    area_total, value_total = sum(areas.values()), sum(expected.values())
    for name, value in expected.items():
        share = areas[name] / area_total
        assert share == pytest.approx(value / value_total, rel=0.01), name


def test_page_loads_without_console_errors(gpt_page):
    assert gpt_page.errors == []
    assert [m for m in gpt_page.messages if m[0] in ("error", "warning")] == []
    assert all(url.startswith(("file:", "data:")) for url in gpt_page.requests), gpt_page.requests


def test_treemap_areas_are_proportional_to_module_flops(gpt_page, gpt):
    doc, page = gpt[1], gpt_page.page
    flops = lambda m: m["forward_flops"] + m["backward_flops"]  # noqa: E731
    _assert_proportional(gpt_page.cells(), _expected_cells(doc, "", flops))
    page.click("#treemap g.cell-g[data-module='h']")  # zoom into the blocks
    _assert_proportional(gpt_page.cells(), _expected_cells(doc, "h", flops))
    page.click("#treemap g.cell-g[data-module='h.0']")
    _assert_proportional(gpt_page.cells(), _expected_cells(doc, "h.0", flops))
    page.click("#tm-up")
    _assert_proportional(gpt_page.cells(), _expected_cells(doc, "h", flops))
    page.click("#tm-crumbs a[data-module='']")  # back to the whole model
    _assert_proportional(gpt_page.cells(), _expected_cells(doc, "", flops))
    page.select_option("#tm-metric", "activation_bytes")
    _assert_proportional(gpt_page.cells(), _expected_cells(doc, "", lambda m: m["activation_bytes"]))
    page.select_option("#tm-metric", "flops")


def test_hovering_the_timeline_peak_shows_the_peak_node(gpt_page, gpt):
    doc, page = gpt[1], gpt_page.page
    peak = doc["memory"]["peak_train"]
    page.locator("#timeline").scroll_into_view_if_needed()
    marker = page.locator("#tl-peak-marker").bounding_box()
    overlay = page.locator("#tl-overlay").bounding_box()
    page.mouse.move(marker["x"] + marker["width"] / 2, overlay["y"] + overlay["height"] / 2)
    tip = page.locator("#tl-tip")
    assert tip.is_visible()
    text = tip.inner_text()
    assert f"node {peak['node']}\n" in text and "the peak" in text, text
    assert f"({peak['bytes']:,} B)" in text  # the live total at that op is the training peak
    page.mouse.move(overlay["x"] + 1, overlay["y"] + 5)  # the first op is not the peak
    assert "the peak" not in tip.inner_text()
    page.focus("#timeline")  # the keyboard reaches every op, one at a time, even where a column shows two
    names = _embedded(page.content())["timeline"]["names"]
    page.keyboard.press("End")
    assert f"node {names[-1]}\n" in tip.inner_text()
    page.keyboard.press("ArrowLeft")
    assert f"node {names[-2]}\n" in tip.inner_text()


def _first_row(page) -> str:
    return page.locator("#nt-body tr").first.locator("td").first.inner_text()


def test_sorting_by_flops_puts_the_top_node_first(gpt_page, gpt):
    doc, page = gpt[1], gpt_page.page
    nodes = doc["nodes"]
    flops = lambda n: n["forward_flops"] + n["backward_flops"]  # noqa: E731
    page.click("#nt-head th[data-key='flops']")
    assert page.get_attribute("#nt-head th[data-key='flops']", "aria-sort") == "descending"
    assert _first_row(page) == max(nodes, key=flops)["name"]
    page.click("#nt-head th[data-key='flops']")
    assert _first_row(page) == min(nodes, key=flops)["name"]  # ascending; ties keep the JSON's order
    page.click("#nt-head th[data-key='activation_bytes']")
    assert _first_row(page) == max(nodes, key=lambda n: n["activation_bytes"])["name"]


def test_filtering_narrows_the_rows(gpt_page, gpt):
    doc, page = gpt[1], gpt_page.page
    rows = page.locator("#nt-body tr")
    assert rows.count() == len(doc["nodes"])
    query = "h.1.mlp"
    expected = [n["name"] for n in doc["nodes"]
                if any(query in str(n[k]).lower() for k in ("name", "op", "module", "kind", "dtype"))]
    page.fill("#nt-filter", query)
    assert 0 < rows.count() == len(expected) < len(doc["nodes"])
    assert page.locator("#nt-count").inner_text() == f"{len(expected)} of {len(doc['nodes'])} nodes"
    page.fill("#nt-filter", "h.1.mlp addmm")  # every word must match
    assert rows.count() == sum(1 for n in doc["nodes"] if n["module"].startswith(query) and "addmm" in n["op"])
    page.fill("#nt-filter", "")
    assert rows.count() == len(doc["nodes"])


def test_runtime_shows_measured_beside_predicted_per_module(browser, tmp_path):
    args = [*MLP, "--runtime", "--device", "cpu", "--steps", "2", "--warmup", "1"]
    report = Page(browser, _profile(tmp_path, "mlp", args, "html"))
    doc = _embedded(report.page.content())
    runtime = doc["runtime"]
    assert report.errors == [] and not [m for m in report.messages if m[0] == "error"]
    rows = report.page.locator("#time-modules tbody tr")
    assert rows.count() == len(runtime["modules"]) > 0
    heads = report.page.locator("#time-modules thead th").all_inner_texts()
    assert heads[:5] == ["module", "FLOPs", "predicted", "measured", "measured ÷ predicted"]
    for i, row in enumerate(runtime["modules"]):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[0] == (row["module"] or "(root)")
        assert (cells[3] != "–") == (row["measured_ms"] is not None)
    report.page.close()


def _table(page, table_id: str) -> list[list[str]]:
    return page.eval_on_selector_all(f"#{table_id} tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")


def test_mesh_page_shows_the_mesh_collectives_and_pipeline(browser, tmp_path):
    """Under --mesh the page says whose account it is and shows the collectives, summed by op,
    mesh dim and phase from the JSON report of the same run; under pp, one row per rank with its
    peak. A single-device page keeps the section hidden."""
    llama = [target("examples/llama.py:Llama"), "-k", "n_layers=2", "--batch", "2", "--mesh", "fsdp=2,tp=2",
             "--parallelize", target("examples/llama.py:parallelize")]
    doc = json.loads(_profile(tmp_path, "mesh", llama, "json").read_text())
    page = Page(browser, _profile(tmp_path, "mesh", llama, "html"))
    try:
        assert page.errors == []
        line = page.page.text_content("#mesh-line")
        assert line.startswith("--mesh fsdp=2,tp=2: 4 ranks; every figure on this page is rank 0's")
        sums: dict = {}
        for c in doc["collectives"]:
            s = sums.setdefault((c["op"], c["mesh_dim"], c["phase"]), [0, 0])
            s[0] += c["count"]
            s[1] += c["wire_bytes"]
        rows = _table(page.page, "collectives")
        assert {(r[0], r[1], r[2]): int(r[3]) for r in rows} == {k: v[0] for k, v in sums.items()}
        wire_titles = page.page.eval_on_selector_all("#collectives tbody tr td:nth-child(6)", "tds => tds.map(t => t.title)")
        assert sorted(int(t.replace(",", "")) for t in wire_titles) == sorted(v[1] for v in sums.values())
    finally:
        page.page.close()
    pp = [*GPT, "--mesh", "pp=2", "--microbatches", "2"]
    doc = json.loads(_profile(tmp_path, "pp", pp, "json").read_text())
    page = Page(browser, _profile(tmp_path, "pp", pp, "html"))
    try:
        assert "(pipeline stage 0)" in page.page.text_content("#mesh-line")
        peaks = page.page.eval_on_selector_all("#pipeline-stages tbody tr td:nth-child(4)", "tds => tds.map(t => t.title)")
        assert [int(t.replace(",", "")) for t in peaks] == [s["peak_bytes"] for s in doc["pipeline"]["stages"]]
    finally:
        page.page.close()
    single = Page(browser, _profile(tmp_path, "single", GPT, "html"))
    try:
        assert single.page.is_hidden("#parallel")
    finally:
        single.page.close()

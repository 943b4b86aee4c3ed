"""`--format html` on a terminal without -o is refused in one line (exit 2) before any work; piped
or with -o it is written. The terminal is a real pseudo-terminal (os.openpty) given to the CLI's
stdout in a subprocess; the page itself shows its summary and totals as static HTML, readable
without JavaScript."""

from __future__ import annotations

import os
import subprocess
import sys
from html.parser import HTMLParser

from helpers import ROOT, target

TWO_LAYER = target("examples/two_layer.py:TwoLayer")


def _on_a_terminal(*args: str) -> subprocess.CompletedProcess:
    leader, follower = os.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", *args], stdout=follower,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    finally:
        os.close(follower)
    os.set_blocking(leader, False)
    try:
        proc.stdout = os.read(leader, 1 << 20).decode(errors="replace")
    except OSError:  # nothing written: EAGAIN, or EIO once the follower is closed (Linux)
        proc.stdout = ""
    finally:
        os.close(leader)
    return proc


def test_html_to_a_terminal_is_refused_in_one_line():
    proc = _on_a_terminal(TWO_LAYER, "--format", "html")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "add -o FILE.html" in proc.stderr, proc.stderr
    assert "<html" not in proc.stdout


def test_html_to_a_terminal_with_output_and_html_piped_are_written(tmp_path):
    out = tmp_path / "p.html"
    proc = _on_a_terminal(TWO_LAYER, "--format", "html", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().lstrip().lower().startswith("<!doctype html")
    piped = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", TWO_LAYER, "--format", "html"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert piped.returncode == 0 and piped.stdout.lstrip().lower().startswith("<!doctype html"), piped.stderr


class _Text(HTMLParser):
    """The text a browser without JavaScript shows: everything outside <script> and <style>."""

    def __init__(self):
        super().__init__()
        self.skip, self.parts, self.cells, self.row = 0, [], [], None

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style")
        if tag == "tr":
            self.row = []

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")
        if tag == "tr" and self.row is not None:
            self.cells.append(self.row)
            self.row = None

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)
            if self.row is not None and data.strip():
                self.row.append(data.strip())


def test_the_page_shows_the_summary_and_totals_without_javascript():
    page = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", TWO_LAYER, "--batch", "2", "--format", "html"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300).stdout
    text = _Text()
    text.feed(page)
    shown = " ".join(" ".join(text.parts).split())
    # TwoLayer, B=2: forward 2·B·(D·H + H·K) = 2·2·(9 + 6) = 60 FLOPs; backward 84 (dW2, dX1 = g·W2ᵀ, dW1)
    totals = {r[0]: r[1] for r in text.cells if len(r) == 2}
    assert totals["forward FLOPs"] == "60" and totals["backward FLOPs"] == "84", totals
    assert totals["parameters"] == "15" and totals["parameter bytes"] == "60 B", totals  # 15 fp32 parameters
    assert "FLOPs 144 per step = forward 60 + backward 84" in shown, shown
    assert "config batch 2, model dtypes, adamw, loss sum" in shown, shown

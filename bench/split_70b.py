"""Where the CPU seconds of bench/speed.py's ``llama2-70b`` row go: fxacct's single-device profile
of the Llama-2-70B shape (T=4096) against FlopCounterMode, each a whole process, split by markers.

    python bench/split_70b.py            # 3 rounds of the four processes, medians

Four processes per round, alternating so they see the same machine load (CPU seconds, user + sys,
from wait4; the markers are ``time.process_time()`` inside the process):
- build: python, ``import torch``, the meta model, and the interpreter's exit with it alive;
- FlopCounterMode: the build, then a fake-tensor forward and backward under FlopCounterMode;
- fxacct: the build, ``fxacct.profile_module`` (with the seconds of the collections the collector
  ran inside it, from gc.callbacks: the young one as fxacct switches the collector back on, which
  walks everything the call made), and the script's end: the exit is the rest;
- fxacct, result dropped: the same, then ``del`` of the result and a full collection (what freeing
  the result's cyclic objects costs, and how many there are).

What the row's target (at most 0.5x) leaves fxacct: 0.5 * FlopCounterMode - build. The split shows
what each part of fxacct's process takes against it; the result's objects are mostly the FX graph
of the traced step (a ``Node`` and its ``meta``, ``users`` and input dicts, ``args`` and ``kwargs``
per op: torch.fx's own), which every report and the JSON contract read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

BUILD = r'''
import sys, time, torch
sys.path[:0] = [{here!r}, {root!r}]
from llama_shapes import Llama, SHAPES
idx = torch.empty(1, 4096, dtype=torch.long, device="meta")
with torch.device("meta"):
    model = Llama(**SHAPES["llama2-70b"], T=4096)
mark = lambda name: print(name, time.process_time(), file=sys.stderr)
mark("built")
'''

FLOPCOUNTER = BUILD + r'''
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
with FakeTensorMode(allow_non_fake_inputs=True):
    with FlopCounterMode(display=False) as fc:
        model(idx).float().sum().backward()
mark("end")
'''

FXACCT = BUILD + r'''
import gc
import fxacct
spent = [0.0, 0.0]  # seconds in collections, the start of the current one

def timed(phase, info):
    if phase == "start":
        spent[1] = time.process_time()
    else:
        spent[0] += time.process_time() - spent[1]

gc.callbacks.append(timed)
p = fxacct.profile_module(model, (idx,), {{}}, fxacct.Config(batch=1))
mark("profiled")
gc.callbacks.remove(timed)
print("collections", spent[0], file=sys.stderr)
print("nodes", len(p.capture.graph.nodes), file=sys.stderr)
if {drop}:
    mark("dropping")
    del p
    print("freed", gc.collect(), file=sys.stderr)
    mark("dropped")
mark("end")
'''


def run(code: str) -> tuple[float, dict]:
    """(CPU seconds of the whole process, its markers)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(err[-2000:])
    marks = {}
    for line in err.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("built", "profiled", "collections", "dropping", "dropped", "end", "nodes", "freed"):
            marks[parts[0]] = float(parts[1])
    return usage.ru_utime + usage.ru_stime, marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    paths = dict(here=str(HERE), root=str(ROOT))
    rows: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for _ in range(rounds):
        build, b = run(BUILD.format(**paths))
        fc, _ = run(FLOPCOUNTER.format(**paths))
        fx, m = run(FXACCT.format(drop=False, **paths))
        _, d = run(FXACCT.format(drop=True, **paths))
        note("build process (python, import torch, meta model, exit)", build)
        note("FlopCounterMode process", fc)
        note("fxacct process", fx)
        note("ratio fxacct / FlopCounterMode", fx / fc)
        note("FlopCounterMode's own (process - build)", fc - build)
        note("fxacct's own (process - build)", fx - build)
        note("fxacct's budget at 0.5x (0.5 * FlopCounterMode - build)", 0.5 * fc - build)
        note("  import fxacct + profile_module", m["profiled"] - m["built"])
        note("    of which the collector's collections", m["collections"])
        note("  exit beyond the build process's exit", (fx - m["end"]) - (build - b["built"]))
        note("the result's graph: nodes", m["nodes"])
        note("objects freed with the result", d["freed"])
        note("freeing them (del + full collection)", d["dropped"] - d["dropping"])
    width = max(map(len, rows))
    for name, values in rows.items():
        fmt = "{:.0f}" if name.startswith(("the result", "objects")) else "{:.3f}"
        print(f"{name:<{width}}  {fmt.format(statistics.median(values)):>9}   "
              + " ".join(fmt.format(v) for v in values))


if __name__ == "__main__":
    main()

"""fxacct's own speed and memory against torch.utils.flop_counter.FlopCounterMode.

Each measurement is a whole process (python start, torch import, meta model build included),
timed by CPU time (user + sys, from wait4) with its peak RSS; fxacct and FlopCounterMode runs
alternate in pairs so both see the same machine load, and the ratio is taken per pair.

    python bench/speed.py               # 7B at T=2048, 70B at T=4096, HF 70B at T=2048, 3 pairs each
    python bench/speed.py --pairs 1 --only llama2-7b

Targets (issue 2): median ratio fxacct / FlopCounterMode ≤ 1.0; 70B at T=4096 under 1 GiB RSS.
Issue 11: the Hugging Face LlamaForCausalLM at Llama-2-70B dimensions (T=2048, use_cache=False)
≤ 0.8 (its blocks replay although each carries its own ``layer_idx``).
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

CHILD = r'''
import sys, torch
sys.path[:0] = [{here!r}, {root!r}]
from llama_shapes import Llama, SHAPES
idx = torch.empty(1, {T}, dtype=torch.long, device="meta")
args, kwargs = (idx,), {{}}
if {shape!r}.startswith("hf-"):
    import transformers
    from llama_shapes import hf_llama_config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_llama_config({shape!r}[3:]))
    args, kwargs = (), {{"input_ids": idx, "use_cache": False}}
else:
    with torch.device("meta"):
        model = Llama(**SHAPES[{shape!r}], T={T})
if {tool!r} == "fxacct":
    import fxacct
    p = fxacct.profile_module(model, args, kwargs, fxacct.Config(batch=1))
    t = p.accounting.totals
    total = t.model_flops
else:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        with FlopCounterMode(display=False) as fc:
            out = model(*args, **kwargs)
            out = getattr(out, "logits", out)
            out.float().sum().backward()
    total = fc.get_total_flops()
print(total)
'''


def run(tool: str, shape: str, T: int) -> tuple[float, int, int]:
    """(CPU seconds, peak RSS bytes, FLOPs printed) of one whole process."""
    code = CHILD.format(here=str(HERE), root=str(ROOT), shape=shape, T=T, tool=tool)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{tool} on {shape} failed:\n{err.decode()[-2000:]}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, int(out.decode().split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--only", choices=("llama2-7b", "llama2-70b", "hf-llama2-70b"), default=None)
    args = ap.parse_args()
    cases = [("llama2-7b", 2048), ("llama2-70b", 4096), ("hf-llama2-70b", 2048)]
    rows = []
    for shape, T in cases:
        if args.only and shape != args.only:
            continue
        ratios, fx_cpu, fc_cpu, fx_rss, fc_rss = [], [], [], [], []
        for _ in range(args.pairs):
            a_cpu, a_rss, a_flops = run("fxacct", shape, T)
            b_cpu, b_rss, b_flops = run("flopcounter", shape, T)
            if a_flops != b_flops:
                raise SystemExit(f"{shape}: fxacct counts {a_flops} matmul+attention FLOPs, FlopCounterMode {b_flops}")
            ratios.append(a_cpu / b_cpu)
            fx_cpu.append(a_cpu), fc_cpu.append(b_cpu), fx_rss.append(a_rss), fc_rss.append(b_rss)
        rows.append((f"{shape} T={T}", statistics.median(fx_cpu), statistics.median(fc_cpu),
                     statistics.median(ratios), max(fx_rss), max(fc_rss)))
    print(f"{'case':<20} {'fxacct CPU s':>12} {'FlopCounter CPU s':>18} {'ratio (median of pairs)':>24} "
          f"{'fxacct RSS MiB':>15} {'FlopCounter RSS MiB':>20}")
    for name, a, b, r, ra, rb in rows:
        print(f"{name:<20} {a:>12.2f} {b:>18.2f} {r:>24.3f} {ra / 2**20:>15.0f} {rb / 2**20:>20.0f}")


if __name__ == "__main__":
    main()

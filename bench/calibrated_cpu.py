"""Predicted vs measured step time of the MLP example on this CPU, after calibration (issue 4's
acceptance: within ±30% for the matmul-dominated MLP). A benchmark, not a timed test.

Each round is `fxacct calibrate --device cpu` into a temporary cache dir, then
`fxacct profile examples/mlp.py:MLP --batch 64 --runtime --device cpu --steps 10 --warmup 3`
through the library, in this process; the rounds' ratios (measured / predicted) and their median
are printed, for the step and for each phase.

    python bench/calibrated_cpu.py                # 3 rounds
    python bench/calibrated_cpu.py --rounds 1 --batch 16 --threads 1

On a shared machine other work slows some steps down; the step time is a median over the steps,
the calibration the best of its repetitions, so noise shows as a ratio above 1. The fastest
timed step ("fastest") is printed too: like the calibration, the least disturbed figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fxacct  # noqa: E402
from fxacct.predict import calibrate  # noqa: E402
from fxacct.runtime import RuntimeOptions, run  # noqa: E402

PHASES = ("step", "forward", "backward", "optimizer")


def one_round(batch: int, steps: int, warmup: int) -> dict:
    cal = calibrate.calibrate("cpu")
    calibrate.save(cal)
    config = fxacct.Config(target=str(ROOT / "examples/mlp.py") + ":MLP", batch=batch)
    r = run(config, RuntimeOptions(device="cpu", steps=steps, warmup=warmup))
    m, c = r.measured, r.comparison
    measured = {"step": m.step_s, "forward": m.forward_s, "backward": m.backward_s, "optimizer": m.optimizer_s}
    out = {k: (c.predicted[k], measured[k]) for k in PHASES}
    out["fastest"] = (c.predicted["step"], min(s.step_s for s in m.step_times))
    out["fp32 matmul TFLOP/s"] = cal.matmul_flops_per_s["float32"] / 1e12
    out["DRAM GB/s"] = cal.bandwidth_bytes_per_s / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"MLP (d_model 1024, d_hidden 4096, 4 blocks), batch {args.batch}, fp32, AdamW, on "
          f"{calibrate.cpu_name()} with {torch.get_num_threads()} threads (torch {torch.__version__})")
    ratios = {k: [] for k in PHASES + ("fastest",)}
    with tempfile.TemporaryDirectory(prefix="fxacct-cache-") as cache:
        os.environ["FXACCT_CACHE_DIR"] = cache
        for i in range(args.rounds):
            t0 = time.perf_counter()
            res = one_round(args.batch, args.steps, args.warmup)
            parts = []
            for k in PHASES + ("fastest",):
                pred, meas = res[k]
                ratios[k].append(meas / pred)
                parts.append(f"{k} {1e3 * pred:.1f} → {1e3 * meas:.1f} ms ({meas / pred:.2f})")
            print(f"round {i + 1} ({time.perf_counter() - t0:.0f} s; calibrated fp32 {res['fp32 matmul TFLOP/s']:.3f} "
                  f"TFLOP/s, DRAM {res['DRAM GB/s']:.1f} GB/s): predicted → measured: " + "; ".join(parts))
    print("median measured/predicted: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in ratios.items()))
    step = statistics.median(ratios["step"])
    verdict = "within" if 0.7 <= step <= 1.3 else "OUTSIDE"
    print(f"step time: {verdict} ±30% (median ratio {step:.2f}; fastest step "
          f"{statistics.median(ratios['fastest']):.2f}, the figure least disturbed by other work)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

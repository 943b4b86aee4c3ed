"""Predicted vs measured on a CUDA machine: step time, MFU and peak memory, with ratios.

Runs from source with the library alone (no click, no tabulate: a lent GPU machine may have
neither), so ``PYTHONPATH=. python bench/gpu_check.py``. bench/gpu_check.sh wraps it.

1. Calibrates the local GPU (matmul FLOP/s per dtype, bandwidth; a few seconds) into a temporary
   cache dir, so the user's own calibration is left alone.
2. Runs each case under fxacct.runtime (warm-up, then timed steps under torch.profiler) and prints
   the step time predicted from the datasheet and from the calibration beside the measured one,
   MFU, the predicted peak beside the allocator-level and op-level measured peaks, the predicted
   ``peak_reserved_bytes`` (fxacct's model of the CUDA caching allocator) beside
   ``torch.cuda.max_memory_reserved()``, and the host-to-device transfer of one batch.

Ratios are measured / predicted. ``--device cpu --small`` runs the same report on the CPU with small
configs (a smoke test of this script where there is no GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fxacct  # noqa: E402
from fxacct.devices import DEVICES  # noqa: E402
from fxacct.predict import calibration  # noqa: E402
from fxacct.predict.fused_time import predict_profile  # noqa: E402
from fxacct.predict.roofline import from_gpu  # noqa: E402
from fxacct.runtime import RuntimeOptions, run  # noqa: E402
from fxacct.runtime.compare import achieved_flops_per_s, mfu  # noqa: E402
from fxacct.tools import calibrate  # noqa: E402
from fxacct.units import GiB  # noqa: E402

SMALL = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=100),
    "mlp": dict(d_model=128, d_hidden=256, n_blocks=2),
    "llama": dict(n_layers=2),
}
CASES = {
    "gpt2": ("GPT-2 124M, batch 8, T 1024, bf16 AMP, AdamW",
             fxacct.Config(target=str(ROOT / "examples/gpt2.py") + ":GPT", batch=8, amp=torch.bfloat16)),
    "mlp": ("MLP (4 blocks, 1024→4096), batch 64, fp32, AdamW",
            fxacct.Config(target=str(ROOT / "examples/mlp.py") + ":MLP", batch=64)),
    "llama": ("Llama (8 layers, dim 2048, GQA 16/8 heads, FFN 5632, T 2048), batch 4, bf16 AMP, AdamW",
              fxacct.Config(target=str(ROOT / "examples/llama.py") + ":Llama", batch=4, amp=torch.bfloat16,
                            kwargs=dict(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8,
                                        hidden=5632, max_seq=2048))),
}


def ms(seconds):
    return "-" if seconds is None else f"{1e3 * seconds:9.3f} ms"


def gib(nbytes):
    return "-" if nbytes is None else f"{nbytes / GiB:9.3f} GiB"


def ratio(a, b):
    return "-" if a is None or not b else f"{a / b:.3f}"


def report(title: str, r, seconds: float) -> None:
    m, c, p = r.measured, r.comparison, r.profile
    print(f"\n== {title} ({seconds:.0f} s)")
    print(f"   device {m.device} ({m.device_name}); {m.steps} timed steps after {m.warmup} warm-up; "
          f"gpu rules: {p.config.gpu}")
    datasheet = predict_profile(p, from_gpu(DEVICES[p.config.gpu])) if p.config.gpu in DEVICES else None
    rows = [("step time, GPU kernel model", datasheet.step_s if datasheet else None, m.step_s),
            ("step time, calibrated roofline", c.predicted.get("step"), m.step_s)]
    if not m.inference:
        rows += [("  forward + loss (calibrated)", c.predicted.get("forward"), m.forward_s),
                 ("  backward (calibrated)", c.predicted.get("backward"), m.backward_s),
                 ("  optimizer (calibrated)", c.predicted.get("optimizer"), m.optimizer_s)]
    print(f"   {'':34} {'predicted':>12} {'measured':>12}  measured/predicted")
    for name, pred, meas in rows:
        print(f"   {name:34} {ms(pred):>12} {ms(meas):>12}  {ratio(meas, pred)}")
    for name, meas in (("peak memory, allocator", m.peak_bytes), ("peak memory, op level", m.op_level_peak_bytes)):
        print(f"   {name:34} {gib(c.predicted_peak_bytes):>12} {gib(meas):>12}  {ratio(meas, c.predicted_peak_bytes)}")
    reserved = p.memory.reserved.peak_reserved_bytes if p.memory.reserved is not None else None
    print(f"   {'peak memory, reserved':34} {gib(reserved):>12} {gib(m.reserved_bytes):>12}  "
          f"{ratio(m.reserved_bytes, reserved)}")
    u = mfu(c, m)
    achieved = achieved_flops_per_s(c, m)
    print(f"   achieved {achieved / 1e12:.1f} TFLOP/s of model FLOPs; MFU "
          f"{'-' if u is None else f'{100 * u:.1f}%'} of {c.peak_flops_per_s / 1e12:.1f} TFLOP/s ({c.peak_source})"
          if achieved and c.peak_flops_per_s else "   achieved: -")
    if m.transfer is not None:
        t = m.transfer
        print(f"   input batch {t.bytes / 2**20:.2f} MiB to the GPU: pageable {ms(t.pageable_s).strip()}, "
              f"pinned non_blocking {ms(t.pinned_s).strip()} (step {ms(m.step_s).strip()})")
    if m.join is not None:
        print(f"   profiler join: {m.join.matched}/{m.join.expected} forward op nodes matched")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", choices=sorted(CASES), action="append")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="small configs at batch 2 (a smoke test)")
    ap.add_argument("--calibrate-s", type=float, default=1.0, help="the calibration's time budget in seconds")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch " + torch.__version__ + "); nothing to check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else calibration.cpu_name()
    print(f"fxacct gpu check: torch {torch.__version__}, CUDA {torch.version.cuda}, {name}")
    with tempfile.TemporaryDirectory(prefix="fxacct-cache-") as cache:
        os.environ["FXACCT_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        try:  # a GPU idling at a low clock ramps up during the first rounds: a refusal is reported, not fatal
            cal = calibrate.calibrate(args.device, budget_s=args.calibrate_s)
        except fxacct.FxacctError as e:
            print(f"calibration refused ({e}); the calibrated rows fall back to the datasheet")
        else:
            calibration.save(cal)
            rates = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in cal.matmul_flops_per_s.items())
            print(f"calibrated in {time.perf_counter() - t0:.1f} s: matmul TFLOP/s {rates}; "
                  f"bandwidth {cal.bandwidth_bytes_per_s / 1e9:.0f} GB/s")
        if args.device == "cuda":  # the calibration's cached blocks are no part of the first case's reserved
            torch.cuda.empty_cache()
        for key in args.only or CASES:
            title, config = CASES[key]
            if args.small:
                title, config = f"{key}, small, batch 2", dataclasses.replace(config, batch=2, kwargs=SMALL[key])
            t0 = time.perf_counter()
            r = run(config, RuntimeOptions(device=args.device, steps=args.steps, warmup=args.warmup))
            report(title, r, time.perf_counter() - t0)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

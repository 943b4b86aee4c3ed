"""fxacct's own speed and memory against torch.utils.flop_counter.FlopCounterMode.

Each measurement is a whole process (python start, torch import, meta model build included),
timed by CPU time (user + sys, from wait4) with its peak RSS; fxacct and FlopCounterMode runs
alternate in pairs so both see the same machine load, and the ratio is taken per pair.

    python bench/speed.py               # 7B at T=2048, 70B at T=4096, HF 70B at T=2048, 3 pairs each
    python bench/speed.py --pairs 1 --only llama2-7b

Targets (issue 2): median ratio fxacct / FlopCounterMode ≤ 1.0; 70B at T=4096 under 1 GiB RSS.
Issue 11: the Hugging Face LlamaForCausalLM at Llama-2-70B dimensions (T=2048, use_cache=False)
≤ 0.8 (its blocks replay although each carries its own ``layer_idx``).

Issue 25 (``--only startup``, ``--only hf-small``; bench/speed.py's functions startup_main and
hf_small_main): ``fxacct --help``, ``--version`` and six usage errors, wall time of whole processes
(median), each paired with ``python -c "import torch"`` (they must answer before it: target < 0.5 s);
the tiny Qwen2 (4 layers, hidden 128, 4.9M parameters, from a Qwen2Config saved to a temporary
directory) ``--batch 2 --seq-len 128`` paired with the imports it cannot avoid (torch, torch._dynamo
which FakeTensorMode imports, transformers and the model class, leaving by os._exit as the CLI
does): target < 3 s; with ``--gpu h100``
paired with the same command under the bracket-and-bisection search fxacct ran before (both largest
batches printed, which must agree): target < 4 s. transformers imports its optional integrations
(scipy, torchao, the kernels hub client, triton) with the model class whenever they are installed:
the row first says which the interpreter has. ``--python`` runs every measured process under
another interpreter, e.g. a virtual environment holding fxacct and only what the row needs
(``python -m venv /tmp/v && /tmp/v/bin/pip install torch==2.13.0 -e . 'transformers>=4.40,<5.25'``).

Issue 9 (``--only llama2-70b-mesh``): examples/llama.py at Llama-2-70B dimensions (T=4096) under
``--mesh fsdp=8,tp=8`` with its own ``parallelize``, paired against the same model's
single-device profile (both through ``fxacct.profile``, as the CLI runs them): target ≤ 1.5.

Issue 25 (``--only plan-70b``): ``fxacct plan`` on that shape with tensor and pipeline parallel
layouts (64 H100s, 8 a node, global batch 512, its ``parallelize`` and ``pipeline_stage``), a
whole process without the disk cache (``--no-cache``), ``--jobs`` as given (default: the cores):
wall and CPU seconds (the workers' included), the layouts traced, reused and pruned, and whether
the top layout fits on a full trace. Target: under 180 s wall on an idle 2-core machine. No
reference to pair with (the command did not finish in 900 s before); ``--pairs`` runs it again.

Issue 23 (``--only titan-8b``): ``fxacct profile torchtitan:llama3:llama3_8b --mesh fsdp=8 --batch 1``
(torchtitan's own 8B job, sequence 8192), a whole process, paired with one that imports what it
cannot avoid (torch, torchtitan's trainer and the llama3 model spec): wall, CPU and peak RSS.
Target: under 60 s wall. Needs torchtitan (pip install 'fxacct[torchtitan]').

Before any row, fxacct's sources (and the bench's and examples' model files) are byte-compiled
into their ``__pycache__`` (``compiled_sources``), as ``pip install`` compiles a wheel's modules
and as Python does itself on the first import where it may write: where ``PYTHONDONTWRITEBYTECODE``
is set, every process would otherwise compile fxacct's ~170 modules again (0.2 s of the tiny Qwen2's CLI run),
which the torch and transformers modules of every reference, byte-compiled in site-packages, never
pay. ``--source-only`` removes those ``__pycache__`` instead (each process then compiles what it
imports, as an editable install does under that variable).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable  # the interpreter every measured process runs (--python)

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

# issue 9: one process profiles examples/llama.py at 70B dimensions, single-device or under a mesh
MESH_CHILD = r'''
import sys
sys.path[:0] = [{root!r}]
import fxacct
example = {root!r} + "/examples/llama.py"
kw = dict(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden=28672, max_seq=4096)
mesh = {mesh!r}
p = fxacct.profile(fxacct.Config(target=example + ":Llama", batch=1, kwargs=kw, mesh=mesh,
                                 parallelize=example + ":parallelize" if mesh else None))
print(p.accounting.totals.model_flops)
'''
MESH = "fsdp=8,tp=8"

PLAN_CASE = "plan-70b"
PLAN_ARGS = ["plan", "examples/llama.py:Llama", "-k", "vocab_size=32000", "-k", "dim=8192", "-k", "n_layers=80",
             "-k", "n_heads=64", "-k", "n_kv_heads=8", "-k", "hidden=28672", "-k", "max_seq=4096",
             "--parallelize", "examples/llama.py:parallelize", "--pp-split", "examples/llama.py:pipeline_stage",
             "--loss", "cross-entropy", "--gpus", "64", "--gpu", "h100", "--gpus-per-node", "8",
             "--global-batch", "512", "--no-cache", "--format", "json"]


def run(tool: str, shape: str, T: int) -> tuple[float, int, int]:
    """(CPU seconds, peak RSS bytes, FLOPs printed) of one whole process."""
    if shape.endswith("-mesh"):
        code = MESH_CHILD.format(root=str(ROOT), mesh=MESH if tool == "mesh" else None)
    else:
        code = CHILD.format(here=str(HERE), root=str(ROOT), shape=shape, T=T, tool=tool)
    proc = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{tool} on {shape} failed:\n{err.decode()[-2000:]}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, int(out.decode().split()[-1])


SOURCES = ("fxacct", "cli", "bench", "examples")


def compiled_sources(compiled: bool) -> None:
    """fxacct's modules byte-compiled where Python keeps them, or (``compiled`` False) none of them
    (module docstring)."""
    if compiled:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([PYTHON, "-m", "compileall", "-q", *SOURCES], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return
    for top in SOURCES:
        for cache in (ROOT / top).rglob("__pycache__"):
            shutil.rmtree(cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--only", choices=("llama2-7b", "llama2-70b", "hf-llama2-70b", MESH_CASE, "startup", "hf-small",
                                       PLAN_CASE, TITAN_CASE), default=None)
    ap.add_argument("--jobs", type=int, default=None, help=f"{PLAN_CASE}: fxacct plan --jobs (default: the cores)")
    ap.add_argument("--source-only", action="store_true", help="fxacct's modules not byte-compiled (module docstring)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of every measured process, e.g. a virtual environment's with fxacct and "
                         "only what the row needs (module docstring); default: this one")
    args = ap.parse_args()
    global PYTHON
    PYTHON = args.python
    compiled_sources(not args.source_only)
    if args.only == "startup":
        return startup_main(args.pairs)
    if args.only == "hf-small":
        return hf_small_main(args.pairs)
    cases = [("llama2-7b", 2048), ("llama2-70b", 4096), ("hf-llama2-70b", 2048)]
    if args.only == MESH_CASE:  # opt-in: two 70B profiles per pair
        return mesh_main(args.pairs)
    if args.only == PLAN_CASE:  # opt-in: minutes per run
        return plan_main(args.pairs, args.jobs)
    if args.only == TITAN_CASE:  # opt-in: needs torchtitan
        return titan_main(args.pairs)
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


MESH_CASE = "llama2-70b-mesh"


def mesh_main(pairs: int) -> None:
    """Issue 9: the --mesh profile against the same model's single-device one, paired."""
    ratios, mesh_cpu, single_cpu, mesh_rss, single_rss = [], [], [], [], []
    for _ in range(pairs):
        a_cpu, a_rss, _ = run("mesh", MESH_CASE, 4096)
        b_cpu, b_rss, _ = run("single", MESH_CASE, 4096)
        ratios.append(a_cpu / b_cpu)
        mesh_cpu.append(a_cpu), single_cpu.append(b_cpu), mesh_rss.append(a_rss), single_rss.append(b_rss)
    print(f"{'case':<28} {'mesh CPU s':>10} {'single CPU s':>13} {'ratio (median of pairs)':>24} "
          f"{'mesh RSS MiB':>13} {'single RSS MiB':>15}")
    print(f"{MESH_CASE + ' ' + MESH:<28} {statistics.median(mesh_cpu):>10.2f} {statistics.median(single_cpu):>13.2f} "
          f"{statistics.median(ratios):>24.3f} {max(mesh_rss) / 2**20:>13.0f} {max(single_rss) / 2**20:>15.0f}")


# issue 25: the CLI's own latency. Each row is a whole process, timed by wall clock (the acceptance
# is wall seconds on an idle machine) and by CPU seconds (a shared machine moves wall time most)
def timed(argv: list[str], env: dict | None = None) -> tuple[float, float, int, bytes]:
    """(wall s, CPU s, exit code, stdout) of one process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status), out


def cli() -> list[str]:
    return [PYTHON, "-m", "fxacct_cli"]


MLP = "examples/mlp.py:MLP"
STARTUP = [  # (row, arguments, exit code)
    ("--help", ["--help"], 0),
    ("--version", ["--version"], 0),
    ("malformed -k", ["profile", MLP, "-k", "d_model"], 2),
    ("missing file", ["profile", "nope.py:Model"], 2),
    ("unwritable -o", ["profile", MLP, "-o", "/nonexistent-dir/p.json"], 2),
    ("bad --mesh", ["profile", MLP, "--mesh", "fsdp=two"], 2),
    ("bad --dtype", ["profile", MLP, "--dtype", "bf17"], 2),
    ("unknown --gpu", ["profile", MLP, "--gpu", "h900"], 2),
]


def import_torch() -> list[str]:
    return [PYTHON, "-c", "import torch"]


def startup_main(pairs: int) -> None:
    """Issue 25 item 1: each answer before torch, paired with a process that only imports torch."""
    print(f"{'case':<16} {'fxacct wall s':>13} {'fxacct CPU s':>12} {'import torch wall s':>19} "
          f"{'ratio (median of pairs)':>24}")
    for name, args, code in STARTUP:
        walls, cpus, refs, ratios = [], [], [], []
        for _ in range(pairs):
            wall, cpu, rc, _ = timed(cli() + args)
            if rc != code:
                raise SystemExit(f"fxacct {' '.join(args)} exited {rc}, expected {code}")
            ref, _, _, _ = timed(import_torch())
            walls.append(wall), cpus.append(cpu), refs.append(ref), ratios.append(wall / ref)
        print(f"{name:<16} {statistics.median(walls):>13.3f} {statistics.median(cpus):>12.3f} "
              f"{statistics.median(refs):>19.3f} {statistics.median(ratios):>24.3f}")


# the 4.9M-parameter Qwen2 of issue 25 (4 layers, hidden 128), saved as a local config
QWEN2 = dict(vocab_size=32000, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
             architectures=["Qwen2ForCausalLM"])
# what the tiny Qwen2's profile cannot avoid: the imports, and no teardown (fxacct's console script
# leaves by os._exit, cli/main.py's main; a process that unloads torch and transformers spends
# 0.5 s more, which would hide fxacct's own seconds)
FLOOR = ("import os, torch, torch._dynamo, transformers; transformers.Qwen2ForCausalLM; os._exit(0)")
# the same CLI run with the largest-batch search fxacct shipped before (fit_search.bracket_search alone)
OLD_SEARCH = r"""
import sys
import fxacct.api as api
from fxacct.memory import fit_search

def bisection(bytes_at, batch, batch_bytes, capacity, max_traces=fit_search.MAX_FIT_TRACES, guess=None):
    probe = fit_search.Probe(bytes_at, capacity, {batch: batch_bytes})
    return (*fit_search.bracket_search(probe, batch, batch_bytes, capacity, max_traces), probe)

api.largest_batch = bisection
from fxacct_cli.main import main
sys.argv = ["fxacct", *sys.argv[1:]]
main()
"""


def _max_batch(out: bytes) -> int:
    return json.loads(out)["memory"]["fit"]["max_batch"]


# packages transformers imports with the model class whenever they are installed, whether the
# model needs them or not (its optional integrations: scipy for its object-detection losses, torchao
# for its quantizers, the kernels hub client, triton): each costs every row its import, fxacct's
# and the floor's alike, so the table says which the interpreter had
OPTIONAL_IMPORTS = ("scipy", "torchao", "kernels", "triton")
OPTIONAL_SEEN = ("import sys, torch, transformers; transformers.Qwen2ForCausalLM; "
                 "print(torch.__version__, transformers.__version__, "
                 f"*(m for m in {OPTIONAL_IMPORTS!r} if m in sys.modules))")


def hf_small_main(pairs: int) -> None:
    """Issue 25 item 2: the tiny Qwen2, plain and with --gpu h100 (the largest-batch search)."""
    import transformers

    torch_version, hf_version, *seen = subprocess.run([PYTHON, "-c", OPTIONAL_SEEN], capture_output=True, text=True,
                                                      check=True).stdout.split()
    print(f"{PYTHON}: torch {torch_version}, transformers {hf_version}; with the model class transformers imports "
          f"{', '.join(seen) or 'none'} of {', '.join(OPTIONAL_IMPORTS)}")

    with tempfile.TemporaryDirectory() as tmp:
        transformers.Qwen2Config(**QWEN2).save_pretrained(tmp)
        args = ["profile", f"hf:{tmp}", "--batch", "2", "--seq-len", "128", "--format", "json"]
        rows = [("qwen2-4.9M", cli() + args, [PYTHON, "-c", FLOOR], "imports"),
                ("qwen2-4.9M --gpu h100", cli() + args + ["--gpu", "h100"],
                 [PYTHON, "-c", OLD_SEARCH, *args, "--gpu", "h100"], "bisection")]
        print(f"{'case':<22} {'fxacct wall s':>13} {'fxacct CPU s':>12} {'reference':>10} {'ref wall s':>10} "
              f"{'ref CPU s':>9} {'ratio (median of pairs)':>24}  largest batch")
        for name, argv, ref_argv, ref_name in rows:
            walls, cpus, ref_walls, ref_cpus, ratios, batches = [], [], [], [], [], set()
            for _ in range(pairs):
                wall, cpu, rc, out = timed(argv)
                ref_wall, ref_cpu, ref_rc, ref_out = timed(ref_argv)
                if rc != 0 or ref_rc != 0:
                    raise SystemExit(f"{name}: exit {rc} / reference exit {ref_rc}")
                if "--gpu" in argv:
                    batches.add((_max_batch(out), _max_batch(ref_out)))
                walls.append(wall), cpus.append(cpu), ref_walls.append(ref_wall), ref_cpus.append(ref_cpu)
                ratios.append(wall / ref_wall)
            if any(a != b for a, b in batches):
                raise SystemExit(f"{name}: largest batch {batches} differs from the bisection's")
            shown = ", ".join(f"{a} (bisection {b})" for a, b in sorted(batches)) or "-"
            print(f"{name:<22} {statistics.median(walls):>13.2f} {statistics.median(cpus):>12.2f} {ref_name:>10} "
                  f"{statistics.median(ref_walls):>10.2f} {statistics.median(ref_cpus):>9.2f} "
                  f"{statistics.median(ratios):>24.3f}  {shown}")


def plan_main(runs: int, jobs: int | None) -> None:
    """Issue 25: the 70B plan with tp and pp layouts, a whole process per run."""
    import json
    import time

    cmd = [*cli(), *PLAN_ARGS] + (["--jobs", str(jobs)] if jobs else [])
    print(f"{'case':<10} {'wall s':>8} {'CPU s':>8} {'layouts':>8} {'traced':>7} {'reused':>7} {'pruned':>7} "
          f"{'traces':>7}  top layout")
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{PLAN_CASE} failed (exit {os.waitstatus_to_exitcode(status)})")
        doc = json.loads(out)
        top = doc["layouts"][0]
        verdict = (f"{top['mesh']} mb {top['micro_batch']} ({top['source']}, "
                   f"{'fits' if top['rank'] == 1 else 'no fit'}, needs {top['fit_bytes'] / 2**30:.2f} GiB)")
        print(f"{PLAN_CASE:<10} {wall:>8.1f} {usage.ru_utime + usage.ru_stime:>8.1f} {doc['layouts_total']:>8} "
              f"{doc['layouts_traced']:>7} {doc['layouts_reused']:>7} {doc['layouts_pruned']:>7} {doc['traces']:>7}  "
              f"{verdict}")


TITAN_CASE = "titan-8b"
TITAN_ARGS = ["profile", "torchtitan:llama3:llama3_8b", "--mesh", "fsdp=8", "--batch", "1", "--format", "json"]
TITAN_IMPORTS = "import torch, torchtitan.trainer, torchtitan.models.llama3.config_registry"


def titan_main(pairs: int) -> None:
    """Issue 23: torchtitan's own 8B job, paired with the imports it cannot avoid."""
    def once(argv):
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(argv[:4])} failed (exit {os.waitstatus_to_exitcode(status)})")
        return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, out

    rows = []
    for _ in range(pairs):
        wall, cpu, rss, out = once(cli() + TITAN_ARGS)
        ref_wall, _, _, _ = once([PYTHON, "-c", TITAN_IMPORTS])
        rows.append((wall, cpu, rss, ref_wall, json.loads(out)["totals"]["peak_train_bytes"]))
    print(f"{'case':<10} {'wall s':>8} {'CPU s':>8} {'RSS MiB':>8} {'imports wall s':>15} {'ratio':>6}  peak_train_bytes")
    for wall, cpu, rss, ref_wall, peak in rows:
        print(f"{TITAN_CASE:<10} {wall:>8.1f} {cpu:>8.1f} {rss / 2**20:>8.0f} {ref_wall:>15.1f} {wall / ref_wall:>6.2f}  {peak}")
    print(f"median wall {statistics.median(r[0] for r in rows):.1f} s (target < 60 s)")


if __name__ == "__main__":
    main()

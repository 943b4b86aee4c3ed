#!/usr/bin/env bash
# fxacct on a CUDA machine, from source, without installing anything (issue 4, item 7).
#
#   bash bench/gpu_check.sh            # < 5 minutes on an H100/H200
#
# 1. bench/gpu_check.py (the library alone): calibrates the GPU into a temporary cache dir, runs
#    GPT-2 124M at bf16 AMP and the MLP under --runtime, prints predicted vs measured step time,
#    MFU and peak memory with ratios (measured / predicted).
# 2. If click, cloup and tabulate import, the same through the CLI for the MLP, with a Chrome trace.
#    If they do not, it says what to install; the library check above does not need them.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "gpu_check: torch sees no CUDA device; run this on the GPU machine" >&2; exit 2; }

"$PY" bench/gpu_check.py "$@"

if "$PY" -c 'import tabulate, click, cloup' 2>/dev/null; then
  # the CLI package is fxacct_cli (the cli/ folder, named so at install): a link makes it importable
  shim="$(mktemp -d)"
  trap 'rm -rf "$shim"' EXIT
  ln -s "$PWD/cli" "$shim/fxacct_cli"
  echo
  echo "== CLI: fxacct profile examples/mlp.py:MLP --batch 64 --runtime (trace: $shim/mlp_trace.json)"
  PYTHONPATH="$shim:$PYTHONPATH" "$PY" -m fxacct_cli profile examples/mlp.py:MLP --batch 64 --runtime \
    --device cuda --steps 10 --warmup 3 --depth 1 --top 5 --trace "$shim/mlp_trace.json" \
    | sed -n '/^predicted step time/,$p'
else
  echo
  echo "click/cloup/tabulate are not installed here: the CLI check was skipped (the library check above"
  echo "does not need them). To run the CLI: pip install click cloup tabulate (or carry their wheels)."
fi

"""One rank's training peak of torchtitan's own Llama 3 8B job beside the shipped torchtitan-style
Llama (examples/llama.py) at the same settings, explained storage by storage: what is live at each
peak, grouped by category, op and module (layer indices folded), largest difference first.

    python bench/titan_vs_examples.py                        # fsdp=8, local batch 1, sequence 8192
    python bench/titan_vs_examples.py --mesh fsdp=8 --batch 2

Needs torchtitan (pip install 'fxacct[torchtitan]'). Same settings: Llama 3.1 8B shapes, FSDP2 with
bf16 parameters and fp32 reductions, per-op selective activation checkpointing of every block,
AdamW, sequence 8192. What differs is written down by torchtitan 0.3.0's job, not chosen here: its
loss is chunked (ChunkedLossWrapper: 8 chunks of the sequence, each chunk's output projection and
cross-entropy run forward and backward inside the loss), its attention projects q, k and v with one
fused matmul, and its RMSNorm computes in fp32; the example computes the full fp32 logits and one
cross-entropy, as the 2024-12 torchtitan of the published runs did (bench/published.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxacct.api import profile  # noqa: E402
from fxacct.load.config import Config  # noqa: E402
from fxacct.memory.peak import lifetimes  # noqa: E402
from fxacct.parallel.fsdp_storage import with_resizes  # noqa: E402

GB = 1e9
SHAPE = dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336, max_seq=8192,
             float_logits=True)


def configs(mesh: str, batch: int) -> dict[str, Config]:
    return {
        "torchtitan llama3_8b": Config(target="torchtitan:llama3:llama3_8b", mesh=mesh, batch=batch),
        "examples/llama.py": Config(target="examples/llama.py:Llama", kwargs=SHAPE, mesh=mesh, batch=batch,
                                    parallelize="examples/llama.py:parallelize_torchtitan",
                                    checkpoint=("layers.*",), checkpoint_policy="examples/llama.py:torchtitan_sac",
                                    loss="cross-entropy"),
    }


def live_at_peak(prof) -> tuple[int, Counter]:
    """(the training peak, bytes live at it by (category, op, module)); resident storages by category."""
    peak = prof.memory.peak_train
    life = lifetimes(prof.capture)
    if prof.parallel is not None:
        life = with_resizes(life, prof.parallel.resizes)
    at = life.op_names.index(peak.node) if peak.node else -1
    nodes = {n.name: n for n in prof.capture.graph.nodes}
    live: Counter = Counter()
    for category, nbytes in life.resident:
        live[(category, "(resident)", "")] += nbytes
    for born, last, category, nbytes in life.born:
        if born <= at <= last:
            node = nodes.get(life.op_names[born])
            cost = node.meta.get("fxacct") if node is not None else None
            module = re.sub(r"layers\.\d+", "layers.N", cost.module if cost is not None else "")
            module = module.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")
            module = module.removeprefix("model.")
            op = re.sub(r"_\d+$", "", life.op_names[born])
            live[(category, op, module)] += nbytes
    return peak.bytes, live


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    results = {name: live_at_peak(profile(c)) for name, c in configs(args.mesh, args.batch).items()}
    (a, (peak_a, live_a)), (b, (peak_b, live_b)) = results.items()
    print(f"training peak, rank 0, --mesh {args.mesh} --batch {args.batch}: {a} {peak_a / GB:.2f} GB, "
          f"{b} {peak_b / GB:.2f} GB, ratio {peak_a / peak_b:.3f}")
    keys = sorted(set(live_a) | set(live_b), key=lambda k: -abs(live_a[k] - live_b[k]))
    rows = [(cat, op, mod or "(root)", live_a[(cat, op, mod)] / GB, live_b[(cat, op, mod)] / GB) for cat, op, mod in keys]
    print(f"{'category':<16}{'op':<28}{'module':<36}{a:>22}{b:>20}")
    for cat, op, mod, x, y in rows:
        if abs(x - y) >= 0.001 or x >= 0.5 or y >= 0.5:
            print(f"{cat:<16}{op:<28}{mod:<36}{x:>19.3f} GB{y:>17.3f} GB")
    print(f"{'sum':<80}{sum(live_a.values()) / GB:>19.3f} GB{sum(live_b.values()) / GB:>17.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

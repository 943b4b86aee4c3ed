"""Per-node and per-module rows as columns (header → getter), for CSV: exact integers, the root
module named "(root)" as in every table (its FQN in the JSON stays "")."""

from __future__ import annotations

import csv
import io

from fxacct.step import Profile

ROOT = "(root)"

NODE_COLUMNS = (
    ("name", lambda n: n.name), ("op", lambda n: n.op), ("module", lambda n: n.module or ROOT),
    ("shape", lambda n: "x".join(str(s) for s in n.shape)), ("dtype", lambda n: n.dtype or ""),
    ("kind", lambda n: n.kind),
    ("forward_flops", lambda n: n.forward.total), ("forward_matmul_flops", lambda n: n.forward.matmul),
    ("forward_attention_flops", lambda n: n.forward.attention), ("forward_other_flops", lambda n: n.forward.other),
    ("backward_flops", lambda n: n.backward.total), ("backward_matmul_flops", lambda n: n.backward.matmul),
    ("backward_attention_flops", lambda n: n.backward.attention),
    ("backward_other_flops", lambda n: n.backward.other),
    ("activation_bytes", lambda n: n.activation_bytes), ("output_bytes", lambda n: n.output_bytes),
    ("unsupported", lambda n: int(n.unsupported)),
)

MODULE_COLUMNS = (
    ("module", lambda m: m.module or ROOT), ("depth", lambda m: m.depth),
    ("forward_flops", lambda m: m.forward.total), ("forward_matmul_flops", lambda m: m.forward.matmul),
    ("forward_attention_flops", lambda m: m.forward.attention), ("forward_other_flops", lambda m: m.forward.other),
    ("backward_flops", lambda m: m.backward.total), ("backward_matmul_flops", lambda m: m.backward.matmul),
    ("backward_attention_flops", lambda m: m.backward.attention),
    ("backward_other_flops", lambda m: m.backward.other), ("activation_bytes", lambda m: m.activation_bytes),
)


def table(p: Profile, by: str = "node"):
    items, columns = (p.accounting.modules, MODULE_COLUMNS) if by == "module" else (p.accounting.nodes, NODE_COLUMNS)
    return [h for h, _ in columns], [[get(x) for _, get in columns] for x in items]


def render_rows(p: Profile, fmt: str, by: str = "node") -> str:
    headers, rows = table(p, by)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(headers)
        w.writerows(rows)
        return buf.getvalue()
    raise ValueError(fmt)

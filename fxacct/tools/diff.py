"""Two profile documents compared (`fxacct diff`): every totals figure side by side with its change,
the modules whose FLOPs or activations changed most, and `--max-increase KEY=PCT` budgets.

Keys are the names under `totals` (nested ones dotted: `forward_flops_by_class.matmul`), plus
`flops` = forward_flops + backward_flops. An increase is (new - old) / old, compared exactly
(the figures are integers); a budget fails when it exceeds PCT percent. A figure that is null in
either file cannot hold a budget (a usage error, so CI does not pass by accident).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from fxacct.errors import UsageError
from fxacct.load.quantities import parse_percent

FLOPS = "flops"  # forward_flops + backward_flops


@dataclass(frozen=True)
class Change:
    key: str
    old: int | float | None
    new: int | float | None

    @property
    def delta(self) -> int | float | None:
        return None if self.old is None or self.new is None else self.new - self.old

    @property
    def ratio(self) -> Fraction | None:
        """(new - old) / old, exact; None when either is missing or old is 0 and new is not."""
        if self.delta is None:
            return None
        if self.old == 0:
            return Fraction(0) if self.new == 0 else None
        return Fraction(self.new) / Fraction(self.old) - 1


@dataclass(frozen=True)
class ModuleChange:
    module: str
    status: str  # changed, added, removed
    flops: Change  # forward + backward
    activation_bytes: Change


@dataclass(frozen=True)
class IncreaseBudget:
    change: Change
    max_percent: Fraction

    @property
    def ok(self) -> bool:
        ratio = self.change.ratio
        if ratio is None:  # from 0 to something: an unbounded increase
            return self.change.new <= self.change.old
        return ratio * 100 <= self.max_percent


@dataclass(frozen=True)
class DiffResult:
    old_model: str | None
    new_model: str | None
    schema: str
    totals: tuple[Change, ...]
    modules: tuple[ModuleChange, ...]  # changed most first, at most `top`
    modules_changed: int
    budgets: tuple[IncreaseBudget, ...]
    config_changes: tuple[Change, ...] = ()  # the step's own settings that differ (CONFIG_KEYS)

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.budgets)


# What makes two profiles different steps rather than two versions of one: shown beside the totals
CONFIG_KEYS = ("mesh", "batch", "tokens_per_example", "dtype", "amp", "optimizer", "loss", "world_size", "shard")


def _config_changes(old: dict, new: dict) -> tuple[Change, ...]:
    a, b = old.get("config") or {}, new.get("config") or {}
    return tuple(Change(k, a.get(k), b.get(k)) for k in CONFIG_KEYS if a.get(k) != b.get(k))


def _with_pipeline(totals: dict, doc: dict) -> dict:
    """Under --mesh pp=P the totals are stage 0's micro-batch; ``pipeline_peak_bytes`` is the
    largest rank's peak over the whole step (the schedule's in-flight micro-batches included)."""
    stages = (doc.get("pipeline") or {}).get("stages") or []
    peaks = [s.get("peak_bytes") for s in stages if isinstance(s.get("peak_bytes"), int)]
    return {**totals, "pipeline_peak_bytes": max(peaks)} if peaks else totals


def flatten_totals(totals: dict) -> dict[str, int | float | None]:
    """Scalar totals by key, nested dicts dotted, plus `flops` (forward + backward)."""
    fwd, bwd = totals.get("forward_flops"), totals.get("backward_flops")
    out: dict[str, int | float | None] = {
        FLOPS: fwd + bwd if isinstance(fwd, (int, float)) and isinstance(bwd, (int, float)) else None}
    for key, value in totals.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if _scalar(v)})
        elif _scalar(value):
            out[key] = value
    return out


def _raw(totals: dict, key: str):
    """The value at a dotted key of a totals object, as the file has it (None where absent)."""
    value = totals
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _scalar(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def parse_increase(text: str) -> tuple[str, Fraction]:
    key, sep, pct = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"malformed --max-increase {text!r}: expected KEY=PCT such as flops=5%")
    return key.strip(), parse_percent(pct, f"--max-increase {key.strip()}")


def _module_changes(old: list, new: list, top: int) -> tuple[tuple[ModuleChange, ...], int]:
    def index(rows):
        return {r.get("module"): r for r in rows if isinstance(r, dict)}

    a, b = index(old or []), index(new or [])
    changes = []
    for name in list(a) + [n for n in b if n not in a]:
        ra, rb = a.get(name), b.get(name)
        status = "removed" if rb is None else "added" if ra is None else "changed"

        def figure(row, key):
            if row is None:
                return 0
            return row.get(key) if key != FLOPS else (row.get("forward_flops") or 0) + (row.get("backward_flops") or 0)

        flops = Change(FLOPS, figure(ra, FLOPS), figure(rb, FLOPS))
        act = Change("activation_bytes", figure(ra, "activation_bytes"), figure(rb, "activation_bytes"))
        if status != "changed" or flops.delta or act.delta:
            changes.append(ModuleChange(name, status, flops, act))
    changes.sort(key=lambda c: (-abs(c.flops.delta or 0), -abs(c.activation_bytes.delta or 0), c.module))
    return tuple(changes[:top]), len(changes)


def diff(old: dict, new: dict, max_increase: tuple[str, ...] = (), top: int = 10) -> DiffResult:
    """Compare two profile documents of the same schema (fxacct.load.profile_file checks both)."""
    ta, tb = (flatten_totals(_with_pipeline(d["totals"], d)) for d in (old, new))
    keys = [k for k in ta if k in tb] + [k for k in ta if k not in tb] + [k for k in tb if k not in ta]
    changes = {k: Change(k, ta.get(k), tb.get(k)) for k in keys}
    budgets = []
    for text in max_increase:
        key, pct = parse_increase(text)
        if key not in changes:
            raise UsageError(f"unknown --max-increase key {key!r}: use one of "
                             f"{', '.join(k for k in keys if '.' not in k)} (or a dotted nested key)")
        change = changes[key]
        if change.old is None or change.new is None:
            which = "both files" if change.old is None and change.new is None else (
                "the baseline" if change.old is None else "the new profile")
            raw = _raw(old["totals"] if change.old is None else new["totals"], key)
            if raw is not None:  # a value fxacct never writes there: the file was edited or is not fxacct's
                raise UsageError(f"--max-increase {key}: totals.{key} is {raw!r} in {which}, not a number; give "
                                 "files written by fxacct profile --format json")
            raise UsageError(f"--max-increase {key}: totals.{key} is null in {which}; profile with the flags "
                             "that compute it, or drop the budget")
        budgets.append(IncreaseBudget(change, pct))
    modules, n_changed = _module_changes(old.get("modules"), new.get("modules"), top)
    return DiffResult(old.get("model"), new.get("model"), old["schema"], tuple(changes.values()), modules,
                      n_changed, tuple(budgets), _config_changes(old, new))

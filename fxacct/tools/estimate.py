"""Back-of-envelope calculators (the seeds' two quick estimates, CS336 lecture 2), each a short
function whose names match the formula, returning a frozen result; fxacct.report.estimate_text
formats them.

- train_time: total FLOPs ÷ (peak FLOP/s × MFU × GPUs × 86,400 s/day). Total FLOPs are 6·N·D
  (Kaplan et al. 2020, §2.1: forward 2N + backward 4N per token), or a profile's own static
  FLOPs per token (forward + backward, matmul + attention: the FLOPs MFU counts) × D.
- max_params: nominal GPU memory ÷ bytes per parameter on one rank (fxacct.memory.per_param); the
  activations, buffers and temporaries are not included.
- flops: 2·m·n·p for (m×n)@(n×p) (1 multiply-add = 2 FLOPs, fxacct.units), or 6·N·D.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from fxacct.devices import get_device
from fxacct.dtypes import dtype_name, parse_dtype
from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct.load.quantities import check_mfu
from fxacct.memory.per_param import BytesPerParam, bytes_per_param
from fxacct.units import FLOPS_PER_FMA

SECONDS_PER_DAY = 24 * 60 * 60  # 86,400 s
DAYS_PER_MONTH = 30  # the seeds' month: "days / 30"
# 6·N·D: per token, forward 2N (one multiply-add per parameter) + backward 4N (gradients of
# activations and of weights), Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1.
FLOPS_PER_PARAM_PER_TOKEN = 6
# The seeds' peak: H100 SXM bf16 dense, 989.5 TFLOP/s (NVIDIA H100 datasheet; fxacct.devices).
DEFAULT_PEAK_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class TrainTime:
    total_flops: int | Fraction  # exact: an integer for 6·N·D
    flops_source: str  # "6·N·D" or "profile"
    tokens: int
    params: int | None  # N of 6·N·D (the profile's parameter count with --from)
    flops_per_token: Fraction
    gpu: str
    peak_dtype: str
    peak_flops_per_s: float  # one GPU, dense
    mfu: float
    world_size: int
    profile_model: str | None = None
    six_n_d_flops: int | None = None  # with --from: the rule of thumb beside the profile's figure
    peak_dtype_source: str = ""  # why this dtype's peak: "--dtype", "profile --amp", ...

    @property
    def flops_per_s(self) -> float:
        """What the whole cluster achieves: peak × MFU × GPUs."""
        return self.peak_flops_per_s * self.mfu * self.world_size

    @property
    def flops_per_day(self) -> float:
        return self.flops_per_s * SECONDS_PER_DAY

    @property
    def days(self) -> float:
        return float(self.total_flops) / self.flops_per_day

    @property
    def months(self) -> float:
        return self.days / DAYS_PER_MONTH


def six_n_d(params: int, tokens: int) -> int:
    return FLOPS_PER_PARAM_PER_TOKEN * params * tokens


def _check_positive(value: int, flag: str) -> None:
    if value <= 0:
        raise UsageError(f"{flag} must be positive, got {value}")


def train_time(tokens: int, gpu: str, mfu: float, world_size: int = 1, params: int | None = None,
               profile_doc: dict | None = None, peak_dtype: torch.dtype | None = None) -> TrainTime:
    """Days to train on ``tokens`` at ``mfu`` of ``world_size`` GPUs' peak: from 6·N·D with
    ``params``, or from a profile document's own FLOPs per token."""
    _check_positive(tokens, "--tokens")
    _check_positive(world_size, "--world-size")
    check_mfu(mfu)
    if (params is None) == (profile_doc is None):
        raise UsageError("give either --params N (6·N·D) or --from PROFILE.json (the profile's FLOPs per token)")
    device = get_device(gpu)
    if peak_dtype is not None and not device.has_peak(peak_dtype):  # int8, bool, complex, float64: no rate known
        raise UsageError(f"--dtype {dtype_name(peak_dtype)}: fxacct knows {device.name}'s matmul peak in "
                         f"{', '.join(device.peak_flops)} only; give one of them")
    six = None
    why = "--dtype" if peak_dtype is not None else "default (the seeds' bf16)"
    if profile_doc is not None:
        per_token, model_params = profile_flops_per_token(profile_doc)
        if peak_dtype is None:
            peak_dtype, why = profile_dtype(profile_doc)
        total, source, model = per_token * tokens, "profile", profile_doc.get("model")
        six = six_n_d(model_params, tokens) if model_params else None
        n = model_params
    else:
        _check_positive(params, "--params")
        total, source, model, n = six_n_d(params, tokens), "6·N·D", None, params
        per_token = Fraction(FLOPS_PER_PARAM_PER_TOKEN * params)
    peak_dtype = peak_dtype or DEFAULT_PEAK_DTYPE
    if isinstance(total, Fraction) and total.denominator == 1:
        total = int(total)
    return TrainTime(total, source, tokens, n, per_token, device.name, dtype_name(peak_dtype),
                     device.matmul_peak(peak_dtype), mfu, world_size, model, six, why)


def profile_flops_per_token(doc: dict) -> tuple[Fraction, int | None]:
    """(forward + backward matmul + attention FLOPs ÷ (batch × tokens per example), parameters)
    of a profile document (fxacct.load.profile_file.read_profile has checked its schema)."""
    totals, config = doc.get("totals") or {}, doc.get("config") or {}
    dims = (doc.get("mesh") or {}).get("dims") or {}
    split = [d for d, size in dims.items() if size > 1 and d not in ("fsdp", "dp")]
    if config.get("mesh") and (split or not dims):  # its FLOPs are a tp group's or a pipeline stage's share
        raise UsageError(f"the profile is one rank's account under --mesh {config['mesh']}, a share of the model's "
                         "FLOPs: estimate from a profile written without --mesh or with fsdp and dp only")
    params = totals.get("params")
    if config.get("mesh"):  # fsdp / dp: each rank runs the whole model on its batch; its parameters are a shard
        params = (doc.get("mesh") or {}).get("model_params")
    tokens, batch = config.get("tokens_per_example"), config.get("batch")
    if not isinstance(batch, int) or batch <= 0:
        raise UsageError("the profile has no config.batch: write it with fxacct profile --format json")
    if not tokens:
        raise UsageError("the profile has no tokens_per_example (its inputs have no integer token ids): "
                         "profile again with --tokens-per-example N")
    try:
        model_flops = sum(totals[f"{phase}_flops_by_class"][cls]
                          for phase in ("forward", "backward") for cls in ("matmul", "attention"))
    except (KeyError, TypeError):
        raise UsageError("the profile lacks totals.forward_flops_by_class/backward_flops_by_class: "
                         "write it with fxacct profile --format json") from None
    return Fraction(model_flops, batch * tokens), params


def profile_dtype(doc: dict) -> tuple[torch.dtype, str]:
    """The matmul dtype whose peak a profile's step runs at, and why: its --amp, else its --dtype,
    else float32 — the rule `fxacct check` applies to the same flags (fxacct.tools.budgets)."""
    config = doc.get("config") or {}
    for flag in ("amp", "dtype"):
        if config.get(flag):
            return parse_dtype(config[flag]), f"the profile's --{flag}"
    return torch.float32, "the profile (no --amp or --dtype: float32, as fxacct check uses)"


@dataclass(frozen=True)
class MaxParams:
    per_param: BytesPerParam
    capacity_bytes: int  # per GPU
    capacity_source: str  # "NVIDIA H100 SXM5 80GB, nominal" or "--max-memory"

    @property
    def max_params(self) -> int:
        """The largest N whose per-rank training state fits: capacity ÷ bytes per parameter per rank."""
        return int(self.capacity_bytes // self.per_param.per_rank)


def max_params(config: Config, gpu: str | None = None, capacity_bytes: int | None = None) -> MaxParams:
    """The largest model whose parameters, gradients, master weights and optimizer state fit one
    rank: nominal capacity (the marketed GB × 1e9, as the seeds use 80e9 for an H100) unless
    ``capacity_bytes`` is given."""
    if capacity_bytes is None:
        if gpu is None:
            raise UsageError("give --gpu NAME (its nominal memory is the budget) or --max-memory SIZE such as 80GB")
        device = get_device(gpu)
        capacity_bytes, source = device.capacity_nominal, f"{device.name}, nominal"
    else:
        if capacity_bytes <= 0:
            raise UsageError(f"--max-memory must be positive, got {capacity_bytes} bytes")
        source = "--max-memory"
    return MaxParams(bytes_per_param(config), capacity_bytes, source)


@dataclass(frozen=True)
class FlopsEstimate:
    flops: int
    formula: str  # "2·m·n·p" or "6·N·D"
    terms: tuple[tuple[str, int], ...]  # the named factors


def matmul_flops(m: int, n: int, p: int) -> FlopsEstimate:
    """(m×n)@(n×p): m·p outputs, each n multiply-adds of 2 FLOPs."""
    for v in (m, n, p):
        _check_positive(v, "--mm dimensions")
    return FlopsEstimate(FLOPS_PER_FMA * m * n * p, "2·m·n·p", (("m", m), ("n", n), ("p", p)))


def training_flops(params: int, tokens: int) -> FlopsEstimate:
    _check_positive(params, "--params")
    _check_positive(tokens, "--tokens")
    return FlopsEstimate(six_n_d(params, tokens), "6·N·D", (("N", params), ("D", tokens)))

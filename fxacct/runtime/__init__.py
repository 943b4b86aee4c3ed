"""Runtime mode: run the real model (timed plain, then under torch.profiler) and put measured time
and memory beside fxacct's prediction.

    >>> r = fxacct.runtime.run(config, RuntimeOptions(device="cpu", steps=10, warmup=3))
    >>> r.measured.step_s, r.comparison.predicted["step"], r.measured.peak_bytes

Order: the static account for the device the run executes on (on CUDA without ``--gpu``, the
local GPU's fxacct.devices entry, so its kernel rules apply) → the roofline prediction for that
device (its calibration, else its datasheet entry, else none) → the safety check (the predicted
peak against free device memory: a ModelError, exit 3, unless ``force``) → the real run
(fxacct.runtime.run) → the comparison (fxacct.runtime.compare).

Modules: setup (device, free memory, the refusal), run (measure), join (profiler events to modules
and nodes), transfer (host-to-device copy of a batch), compare (predicted vs measured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxacct import api
from fxacct.errors import UsageError
from fxacct.load.config import Config
from fxacct.load.run_options import RuntimeOptions
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.roofline import Prediction, for_local
from fxacct.runtime.compare import Comparison, compare
from fxacct.runtime.run import Measured, measure
from fxacct.runtime.setup import check_fits, prediction_config, resolve_device, validate
from fxacct.step import Profile


@dataclass(frozen=True)
class RuntimeResult:
    profile: Profile  # of the config the prediction is for
    prediction: Prediction | None  # on the device the run executed on; None if not calibrated
    measured: Measured
    comparison: Comparison


DEFAULT_OPTIONS = RuntimeOptions()


def run(config: Config, options: RuntimeOptions = DEFAULT_OPTIONS,
        progress: Callable[[str, int, int], None] | None = None) -> RuntimeResult:
    validate(config, options)
    device = resolve_device(options.device)
    config = prediction_config(config, device)
    profile = api.profile(config)
    if not options.inference and not profile.capture.has_backward:  # loss.backward() would raise in the real run
        raise UsageError("nothing in the model trains (no parameter or input requires grad), so a training step "
                         "has no backward to time: give --inference to time the forward (eval, no_grad)")
    model = for_local(device.type, config.gpu, sdpa_backend=config.sdpa_backend)  # the step is timed plain (fxacct.runtime.run)
    prediction = predict_profile(profile, model) if model is not None else None
    memory = profile.memory
    peak = memory.peak_inference if options.inference else memory.rank_peak
    check_fits(peak.bytes if peak is not None else None, device, options.force)
    measured = measure(config, device, options.steps, options.warmup, profile.accounting.nodes,
                       inference=options.inference, keep_trace=options.keep_trace, progress=progress)
    return RuntimeResult(profile, prediction, measured, compare(profile, prediction, measured, config.gpu))


__all__ = ["RuntimeOptions", "RuntimeResult", "run"]

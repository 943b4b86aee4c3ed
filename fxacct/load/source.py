"""Where a model comes from, in the three spec forms (docs/guide.md, "Loading a model"), and how it is
built and fed, on meta for the account and on a real device for ``--runtime``: one path for both.

- ``PATH.py:Name``: a class or factory in a Python file (fxacct.load.model_spec);
- ``package.module:Name``: a class or factory of an importable module (``torch.nn:Linear``);
  a transformers model class takes its config from ``-k config=PATH``;
- ``hf:DIR_OR_CONFIG_JSON``: a Hugging Face model from a local config (fxacct.load.hf).

Inputs, first match wins: the ``--input`` specs; an ``example_inputs(batch)`` method on the model
or function in the file; the form's defaults (Hugging Face: fxacct.load.hf.default_inputs;
a class of ``torchvision.models``: float[B,3,224,224]; a timm model: its ``input_size``).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from fxacct.errors import UsageError, classify
from fxacct.load import fp8, hf
from fxacct.load import model_spec as loading
from fxacct.load.flags import HF_PREFIX, is_module_path  # noqa: F401  (re-exported)
from fxacct.load.inputs import InputSpec
from fxacct.load.torchtitan import is_torchtitan

IMAGE_224 = InputSpec(None, torch.float32, ("B", 3, 224, 224))


@dataclass(frozen=True)
class ModelSource:
    name: str  # for messages
    factory: object  # called with kwargs on the target device
    kwargs: dict
    file_module: ModuleType | None = None
    hf_model: bool = False  # default inputs from fxacct.load.hf

    def build(self, device="meta") -> torch.nn.Module:
        return loading.build(self.factory, self.kwargs, self.name, device)


def open_source(config) -> ModelSource:
    """The ModelSource of config.target (a usage error names what is wrong and the fix)."""
    target, kwargs = config.target, dict(config.kwargs)
    if target is None:
        raise UsageError("Config(target=None): name the model, e.g. Config(target='examples/gpt2.py:GPT'), or profile "
                         "a module you built with fxacct.profile_module(model, args, kwargs, config)")
    if is_torchtitan(target):  # torchtitan builds them (fxacct.parallel.torchtitan), not this loader
        raise UsageError(f"{target}: torchtitan targets are accounted by `fxacct profile` and planned by "
                         "`fxacct plan`; this command does not take them yet")
    if getattr(config, "hf_class", None) is not None and not _is_hf_target(target):
        raise UsageError("--hf-class picks the class of an hf:PATH model; drop it or give hf:DIR_OR_CONFIG_JSON")
    if target.startswith(HF_PREFIX):
        hf_config, build_kwargs = hf.read_config(target[len(HF_PREFIX):], kwargs)
        cls = hf.model_class(hf_config, getattr(config, "hf_class", None))
        return ModelSource(cls.__name__, _hf_factory(cls, hf_config, build_kwargs), {}, None, True)
    if is_module_path(target):
        obj = import_name(target)
        name = target.rpartition(":")[2]
        if hf.is_hf_class(obj):
            return _transformers_class(obj, kwargs)
        return ModelSource(name, obj, kwargs, None)
    obj, file_module = loading.resolve(target)
    if hf.is_hf_class(obj):
        return _transformers_class(obj, kwargs)
    return ModelSource(target.rpartition(":")[2], obj, kwargs, file_module)


def _is_hf_target(target: str) -> bool:
    return target.startswith(HF_PREFIX)


def _hf_factory(cls, hf_config, build_kwargs):
    def factory():
        return hf.build(cls, hf_config, build_kwargs)

    factory.__name__ = cls.__name__
    return factory


def _transformers_class(cls, kwargs: dict) -> ModelSource:
    path = kwargs.pop("config", None)
    if not isinstance(path, str):
        raise UsageError(f"{cls.__name__} is built from a Hugging Face config: pass -k config=PATH "
                         "(a directory or config.json), or profile hf:PATH")
    hf_config, build_kwargs = hf.read_config(path, kwargs)
    return ModelSource(cls.__name__, _hf_factory(cls, hf_config, build_kwargs), {}, None, True)


def import_name(target: str):
    """'torch.nn:Linear' -> the object; a missing module or name is a usage error."""
    module_name, _, name = target.rpartition(":")
    added = [os.getcwd()] if os.getcwd() not in sys.path else []  # a module in the working directory
    sys.path[:0] = added
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        raise UsageError(f"no module named {missing!r} (importing {module_name} for {target}): install it, "
                         "or give PATH.py:Name for a file") from None
    except Exception as e:
        raise classify(e, f"importing {module_name}") from e
    finally:
        for p in added:
            sys.path.remove(p)
    obj = getattr(module, name, None)
    if obj is None:
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], 3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"module {module_name} has no name {name!r}{hint}")
    if isinstance(obj, ModuleType) or (isinstance(obj, type) and not issubclass(obj, torch.nn.Module)):
        kind = "a module" if isinstance(obj, ModuleType) else f"the class {obj.__name__}"
        raise UsageError(f"{target} is {kind}, not an nn.Module class or a factory returning one")
    return obj


def default_inputs(source: ModelSource, model: torch.nn.Module, seq_len: int | None,
                   with_labels: bool) -> tuple[InputSpec, ...] | None:
    """The form's default input specs for a built model, or None."""
    if source.hf_model:
        return hf.default_inputs(model, seq_len, with_labels)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    if isinstance(cfg, dict) and len(cfg.get("input_size", ())) == 3:  # timm: (C, H, W)
        return (InputSpec(None, torch.float32, ("B", *cfg["input_size"])),)
    if (getattr(source.factory, "__module__", "") or "").startswith("torchvision.models"):
        return (IMAGE_224,)
    return None


def specs_inputs(specs, batch: int, device="meta") -> tuple[tuple, dict]:
    args = tuple(s.make(batch, device) for s in specs if s.name is None)
    kwargs = {s.name: s.make(batch, device) for s in specs if s.name is not None}
    return args, kwargs


def inputs(source: ModelSource, model, config, batch: int, device="meta") -> tuple[tuple, dict]:
    """(args, kwargs) for one step at ``batch``: --input specs, example_inputs, the form's defaults."""
    seq_len = getattr(config, "seq_len", None)
    if seq_len is not None and (config.inputs or not source.hf_model):
        raise UsageError("--seq-len sets the default inputs of Hugging Face models; "
                         + ("with --input give the length there" if config.inputs else "give --input for this model"))
    if config.inputs:
        return specs_inputs(config.inputs, batch, device)
    found = loading.example_inputs(model, source.file_module, batch, device)
    if found is not None:
        return found
    specs = _config_defaults(source, model, config)
    if specs is None:
        return loading.require_inputs(None)
    return specs_inputs(specs, batch, device)


def _config_defaults(source: ModelSource, model, config) -> tuple[InputSpec, ...] | None:
    return default_inputs(source, model, getattr(config, "seq_len", None), getattr(config, "loss", "sum") == "model")


def guessed_input_note(config, model) -> str | None:
    """When the model failed on inputs fxacct chose (no --input, no example_inputs): which, and
    the flag that gives others (torchvision's inception_v3 wants 299 × 299, not the family's 224)."""
    if config.inputs:
        return None
    src = open_source(config)
    if loading.example_inputs_fn(model, src.file_module) is not None:
        return None
    specs = _config_defaults(src, model, config)
    if not specs:
        return None
    shown = " ".join(f"--input '{s}'" for s in specs)
    return f"fxacct fed the model its default input ({shown}); if the model takes another, give --input"


__all__ = ["ModelSource", "open_source", "inputs", "default_inputs", "import_name", "is_module_path",
           "guessed_input_note"]


def load_model(config):
    """(model on meta, args, kwargs, inputs_for) for config.target: ``inputs_for(batch) -> (args,
    kwargs)`` builds the inputs of another batch (the largest-batch search)."""
    src = open_source(config)
    model = src.build()
    fp8.convert(model, getattr(config, "fp8", None))  # --fp8: torchao's Float8Linear in place of nn.Linear

    def inputs_for(batch: int):
        return inputs(src, model, config, batch)

    args, kwargs = inputs_for(config.batch)
    return model, args, kwargs, inputs_for

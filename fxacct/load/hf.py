"""Hugging Face models from a local config, never the network: ``hf:DIR_OR_CONFIG_JSON`` and
``transformers:Class -k config=PATH``.

The config is read from the JSON file (a directory means its ``config.json``), its ``model_type``
picks the transformers config class, ``-k NAME=VALUE`` overrides a config field (``-k
attn_implementation=eager`` picks the attention implementation, ``-k experts_implementation=batched_mm``
an MoE model's experts kernel: the default ``grouped_mm`` has a fake kernel for bfloat16 only),
and the model is built with ``from_config`` in float32 (the config's ``torch_dtype`` is not
applied: use ``--dtype``), ``use_cache`` off (a training step keeps no key/value cache). The
class: ``--hf-class``, else the config's first ``architectures`` entry, else
``AutoModelForCausalLM``.

Default inputs (keyword, as the model's forward names them), when no ``--input`` is given:
``input_ids`` long[B, T] below the vocabulary, T = ``--seq-len`` or the config's maximum positions
capped at 2048 (512 when the config has none); ``decoder_input_ids`` likewise for
encoder-decoder models (T capped at the decoder's maximum positions); ``pixel_values``
float[B, C, H, W] from the (vision) config; ``input_features`` float[B, mel bins, 2 × the
encoder's maximum positions] for speech encoders; ``labels`` with ``--loss model``.
"""

from __future__ import annotations

import inspect
import json

import torch

from fxacct.errors import UsageError
from fxacct.load.flags import hf_config_file
from fxacct.load.fp8 import quiet_torchao
from fxacct.load.inputs import InputSpec

MAX_DEFAULT_SEQ = 2048
FALLBACK_SEQ = 512  # configs without a maximum position count (T5's relative positions)
DEFAULT_CLASS = "AutoModelForCausalLM"
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
ATTN = "attn_implementation"
# build-time choices ``from_config`` takes as keywords, not config fields: the attention kernel and
# the MoE experts' (``grouped_mm``, ``batched_mm``, ``eager``)
BUILD_KWARGS = (ATTN, "experts_implementation")


def transformers_module():
    try:
        import transformers
    except ModuleNotFoundError:
        raise UsageError("Hugging Face models need transformers: pip install transformers") from None
    return transformers


def is_hf_class(obj) -> bool:
    """A transformers model class or Auto class (built from a config, not from keyword arguments)."""
    module = getattr(obj, "__module__", "") or ""
    return isinstance(obj, type) and module.startswith("transformers.") and (
        hasattr(obj, "from_config") or hasattr(obj, "_from_config"))


def read_config(path_text: str, overrides: dict):
    """(config object, the kwargs that go to from_config) from a local directory or config.json."""
    file = hf_config_file(path_text)
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{file} is not a JSON config ({e}); give a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise UsageError(f"{file} is not a Hugging Face config (a JSON object with model_type)")
    transformers = transformers_module()
    model_type = data.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        if model_type is None:
            raise UsageError(f"{file} has no model_type; give the config.json of a Hugging Face model "
                             "(it names its architecture, e.g. \"model_type\": \"llama\")")
        raise UsageError(f"{file}: model_type {model_type!r} is unknown to transformers {transformers.__version__}; "
                         "give a config.json of a supported architecture (or upgrade transformers)")
    config = transformers.CONFIG_MAPPING[model_type].from_dict(data)
    build_kwargs = {}
    for key, value in overrides.items():
        if key in BUILD_KWARGS:
            build_kwargs[key] = value
        elif not hasattr(config, key):
            raise UsageError(f"-k {key}: the {type(config).__name__} has no field {key!r}; -k overrides config "
                             f"fields (or -k {ATTN}=eager|sdpa, -k experts_implementation=batched_mm|grouped_mm)")
        else:
            setattr(config, key, value)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config, build_kwargs


def model_class(config, name: str | None):
    """--hf-class, else the config's architectures[0] when transformers has it, else the default."""
    transformers = transformers_module()
    with quiet_torchao():  # the class's module imports transformers' modeling, and torchao where installed
        if name is None:
            archs = getattr(config, "architectures", None) or []
            name = next((a for a in archs if is_hf_class(getattr(transformers, a, None))), DEFAULT_CLASS)
        cls = getattr(transformers, name, None)
    if not is_hf_class(cls):
        raise UsageError(f"--hf-class {name!r} is not a transformers model class: name one such as "
                         f"{DEFAULT_CLASS}, AutoModel or LlamaForCausalLM")
    wants = getattr(cls, "config_class", None)  # None for the Auto* classes, which pick by config
    if isinstance(wants, type) and not isinstance(config, wants):
        raise UsageError(f"--hf-class {name} builds from a {wants.__name__}, and this config is a "
                         f"{type(config).__name__}: name a {getattr(config, 'model_type', 'matching')} class, "
                         f"or AutoModel / {DEFAULT_CLASS}")
    return cls


def build(cls, config, build_kwargs: dict) -> torch.nn.Module:
    """The model, on the current torch.device, float32. Errors are the caller's to classify."""
    kwargs = dict(build_kwargs, dtype=torch.float32)
    if hasattr(cls, "from_config"):
        try:
            with quiet_torchao():  # an Auto class imports its model's module (and torchao) here
                return cls.from_config(config, **kwargs)
        except ValueError as e:
            if "Unrecognized configuration class" in str(e):
                examples = "AutoModelForSeq2SeqLM, AutoModel" if getattr(config, "is_encoder_decoder", False) \
                    else "AutoModel, AutoModelForImageClassification"
                raise UsageError(f"{cls.__name__} cannot build a {type(config).__name__}: pick the class "
                                 f"with --hf-class (e.g. {examples})") from None
            raise
    return cls._from_config(config, **kwargs)


def seq_len_note(model: torch.nn.Module, seq_len: int | None) -> str | None:
    """A line naming the config's position limit when --seq-len passes it (models with learned
    positions fail there; rotary ones need not, so this only explains a failure)."""
    config = getattr(model, "config", None)
    found = _position_field(_sub(config, "text_config")) if config is not None and seq_len is not None else None
    if found is None or found[1] >= seq_len:
        return None
    key, limit = found
    return f"--seq-len {seq_len} is longer than {type(model).__name__}'s {key} ({limit}), the likely cause of this"


def _position_field(config) -> tuple[str, int] | None:
    """(name, value) of the first positive position limit the config declares (_POSITIONS)."""
    for key in _POSITIONS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key, value
    return None


def _positions(config, default: int) -> int:
    found = _position_field(config)
    return default if found is None else found[1]


def _sub(config, name: str):
    return getattr(config, name, None) or config


def default_inputs(model: torch.nn.Module, seq_len: int | None, with_labels: bool) -> tuple[InputSpec, ...]:
    """The keyword inputs a training step of this Hugging Face model takes (module docstring)."""
    config = model.config
    try:
        params = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = {"input_ids"}
    specs = []
    text = _sub(config, "text_config")
    if getattr(text, "vocab_size", None) is None:  # an encoder-decoder of two configs (VisionEncoderDecoder)
        text = getattr(config, "decoder", None) or text
    vocab = getattr(text, "vocab_size", None)
    seq = seq_len or min(_positions(text, FALLBACK_SEQ), MAX_DEFAULT_SEQ)
    if "input_ids" in params and vocab:
        specs.append(InputSpec("input_ids", torch.long, ("B", seq), vocab))
    if "pixel_values" in params:
        vision = _sub(config, "vision_config")
        if not hasattr(vision, "image_size"):
            vision = getattr(config, "encoder", None) or vision
        size = getattr(vision, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        specs.append(InputSpec("pixel_values", torch.float32, ("B", getattr(vision, "num_channels", 3), h, w)))
    if "input_features" in params and hasattr(config, "num_mel_bins"):
        frames = 2 * getattr(config, "max_source_positions", 1500)
        specs.append(InputSpec("input_features", torch.float32, ("B", config.num_mel_bins, frames)))
    decoder_seq = min(seq, getattr(config, "max_target_positions", seq))
    decoder = getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params and vocab
    if decoder:
        if seq_len is not None and decoder_seq < seq_len:
            raise UsageError(f"--seq-len {seq_len} is longer than {type(model).__name__}'s decoder takes "
                             f"(max_target_positions {decoder_seq}); give --seq-len {decoder_seq} or less")
        specs.append(InputSpec("decoder_input_ids", torch.long, ("B", decoder_seq), vocab))
    if not specs:
        raise UsageError(f"no default inputs for {type(model).__name__}: give them with --input NAME=SPEC")
    if seq_len is not None and not any(s.name in ("input_ids", "decoder_input_ids") for s in specs):
        raise UsageError(f"--seq-len: {type(model).__name__} takes no token ids (its default inputs: "
                         f"{', '.join(s.name for s in specs)}); drop --seq-len, or give --input NAME=SPEC")
    if with_labels and "labels" in params:
        specs.append(_labels(model, config, vocab, decoder_seq if config.is_encoder_decoder else seq))
    return tuple(specs)


def _labels(model, config, vocab, seq: int) -> InputSpec:
    """Token labels like the ids for language models; one class per example for classifiers."""
    name = type(model).__name__
    if "Classification" in name and "Token" not in name:
        return InputSpec("labels", torch.long, ("B",), max(getattr(config, "num_labels", 2), 2))
    if vocab is None:
        raise UsageError(f"--loss model: no default labels for {name}; give --input 'labels=long[...]<N'")
    return InputSpec("labels", torch.long, ("B", seq), vocab)


def is_causal_lm(model: torch.nn.Module) -> bool:
    """A transformers causal language model: its labels (and fxacct's cross-entropy targets) are
    the next tokens."""
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())

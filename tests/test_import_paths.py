"""MODEL as PATH.py:Name, package.module:Name or hf:DIR_OR_CONFIG_JSON (issue 11, item 2).

FLOPs are held against torch.utils.flop_counter.FlopCounterMode on the same model built on meta by
hand (tests/helpers.py); Hugging Face models come from tiny config.json files written here (no
network); --runtime builds the same model for real (same parameters, same inputs).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import flop_counter_oracle, meta_input, on_meta, target
from test_cli import assert_one_line_error, invoke, profile_json

import fxacct
from fxacct.errors import UsageError
from fxacct.load.source import load_model

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, torch_dtype="bfloat16")


@pytest.fixture
def llama_json(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def _write(tmp_path, name: str, config: dict):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_torch_nn_class_acceptance_matches_flop_counter():
    doc = profile_json("torch.nn:TransformerEncoderLayer", "-k", "d_model=512", "-k", "nhead=8",
                       "-k", "batch_first=True", "--input", "float[B,128,512]", "--batch", "4")
    assert doc["model"] == "torch.nn:TransformerEncoderLayer"
    assert doc["config"]["inputs"] == ["float32[4,128,512]"] and doc["config"]["loss"] == "sum"
    model = on_meta(torch.nn.TransformerEncoderLayer, d_model=512, nhead=8, batch_first=True)
    fwd, bwd = flop_counter_oracle(model, (meta_input(4, 128, 512),))
    t = doc["totals"]
    by_class = lambda d: d["matmul"] + d["attention"]  # noqa: E731
    assert (by_class(t["forward_flops_by_class"]), by_class(t["backward_flops_by_class"])) == (fwd, bwd)
    # the four projections and the FFN: 2·B·T·(4·512² + 2·512·2048) = 2·512·(1,048,576 + 2,097,152)
    assert fwd == 2 * 4 * 128 * (4 * 512 * 512 + 2 * 512 * 2048) + 2 * 2 * 4 * 8 * 128 * 128 * 64


def test_hf_config_acceptance_matches_flop_counter(llama_json):
    doc = profile_json(f"hf:{llama_json}", "--batch", "4", "--seq-len", "32", "--loss", "cross-entropy")
    assert doc["config"]["inputs"] == ["int64[4,32]"] and doc["config"]["loss"] == "cross-entropy"
    assert doc["totals"]["loss_flops"] > 0
    from transformers import CONFIG_MAPPING, LlamaForCausalLM

    config = CONFIG_MAPPING["llama"](**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    model = on_meta(LlamaForCausalLM, config)
    ids = torch.empty(4, 32, dtype=torch.long, device="meta")
    fwd, bwd = flop_counter_oracle(model, (), {"input_ids": ids}, output=lambda o: o.logits)
    t = doc["totals"]
    assert (t["forward_flops_by_class"]["matmul"] + t["forward_flops_by_class"]["attention"],
            t["backward_flops_by_class"]["matmul"] + t["backward_flops_by_class"]["attention"]) == (fwd, bwd)
    # the config's torch_dtype is not applied (docs/guide.md): float32 unless --dtype
    assert set(doc["by_dtype"]) >= {"float32"} and "bfloat16" not in doc["by_dtype"]


def test_directory_transformers_class_and_hf_give_the_same_account(llama_json):
    a = fxacct.profile(fxacct.Config(target=f"hf:{llama_json.parent}", batch=2, seq_len=16))
    b = fxacct.profile(fxacct.Config(target="transformers:LlamaForCausalLM", batch=2, seq_len=16,
                                     kwargs={"config": str(llama_json)}))
    assert a.accounting.totals == b.accounting.totals
    assert a.memory.peak_train == b.memory.peak_train


def test_hf_defaults_seq_len_class_and_overrides(tmp_path):
    pytest.importorskip("transformers")
    long_ctx = _write(tmp_path, "long.json", {**TINY_LLAMA, "max_position_embeddings": 8192})
    model, args, kwargs, _ = load_model(fxacct.Config(target=f"hf:{long_ctx}", batch=3))
    assert args == () and tuple(kwargs["input_ids"].shape) == (3, 2048)  # capped at 2048
    model, _, kwargs, _ = load_model(fxacct.Config(target=f"hf:{long_ctx}", batch=1, hf_class="AutoModel",
                                                   kwargs={"num_hidden_layers": 1}))
    assert type(model).__name__ == "LlamaModel" and len(model.layers) == 1
    assert model.config.use_cache is False
    no_arch = _write(tmp_path, "plain.json", {k: v for k, v in TINY_LLAMA.items() if k != "architectures"})
    model, _, kwargs, _ = load_model(fxacct.Config(target=f"hf:{no_arch}", batch=1))
    assert type(model).__name__ == "LlamaForCausalLM" and tuple(kwargs["input_ids"].shape) == (1, 64)
    model, _, _, _ = load_model(fxacct.Config(target=f"hf:{no_arch}", kwargs={"attn_implementation": "eager"}))
    assert model.config._attn_implementation == "eager"
    # the MoE experts' kernel is a build keyword too, not a config field
    moe = _write(tmp_path, "moe.json", dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=64,
                                            hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=2))
    model, _, _, _ = load_model(fxacct.Config(target=f"hf:{moe}", kwargs={"experts_implementation": "batched_mm"}))
    assert model.config._experts_implementation == "batched_mm"


def test_hf_default_inputs_of_encoder_decoder_and_vision_models(tmp_path):
    pytest.importorskip("transformers")
    t5 = _write(tmp_path, "t5.json", dict(model_type="t5", architectures=["T5ForConditionalGeneration"],
                                          vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    _, _, kwargs, _ = load_model(fxacct.Config(target=f"hf:{t5}", batch=2, seq_len=8))
    assert {k: tuple(v.shape) for k, v in kwargs.items()} == {"input_ids": (2, 8), "decoder_input_ids": (2, 8)}
    vit = _write(tmp_path, "vit.json", dict(model_type="vit", architectures=["ViTForImageClassification"],
                                            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=4, intermediate_size=64))
    _, _, kwargs, _ = load_model(fxacct.Config(target=f"hf:{vit}", batch=2))
    assert {k: (tuple(v.shape), v.dtype) for k, v in kwargs.items()} == {"pixel_values": ((2, 3, 32, 32), torch.float32)}
    _, _, kwargs, _ = load_model(fxacct.Config(target=f"hf:{vit}", batch=2, loss="model"))
    assert tuple(kwargs["labels"].shape) == (2,)  # one class per image
    # a --seq-len that would change nothing (no token ids) or be cut short is a usage error, never dropped
    assert_one_line_error(invoke("profile", f"hf:{vit}", "--seq-len", "32"), 2, "--seq-len", "takes no token ids")
    whisper = _write(tmp_path, "whisper.json", dict(
        model_type="whisper", architectures=["WhisperForConditionalGeneration"], vocab_size=64, d_model=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=12))
    assert_one_line_error(invoke("profile", f"hf:{whisper}", "--seq-len", "64"), 2, "max_target_positions 12")
    _, _, kwargs, _ = load_model(fxacct.Config(target=f"hf:{whisper}", batch=2, seq_len=12))
    assert tuple(kwargs["decoder_input_ids"].shape) == (2, 12)


def test_hf_vision_encoder_decoder_reads_its_two_configs(tmp_path):
    """A VisionEncoderDecoder's image size is its encoder's (32, not the family's 224) and its
    token ids its decoder's (vocab 64, n_positions 32); it once got 224 × 224 images and no ids.
    A model that still fails on inputs fxacct chose says which it fed and the flag for others."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, VisionEncoderDecoderConfig, ViTConfig

    enc = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64)
    dec = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32, add_cross_attention=True,
                     is_decoder=True, bos_token_id=0, eos_token_id=0)
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id = cfg.pad_token_id = 0
    cfg.save_pretrained(tmp_path / "ved")
    spec = f"hf:{tmp_path / 'ved'}"
    _, _, kwargs, _ = load_model(fxacct.Config(target=spec, hf_class="VisionEncoderDecoderModel", batch=2))
    assert {k: tuple(v.shape) for k, v in kwargs.items()} == {"pixel_values": (2, 3, 32, 32),
                                                              "decoder_input_ids": (2, 32)}
    enc.image_size = 64  # the model wants 64 × 64; a wrong default is fed through --input's flag name
    VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec).save_pretrained(tmp_path / "ved64")
    line = assert_one_line_error(invoke("profile", f"hf:{tmp_path / 'ved64'}", "--hf-class",
                                        "VisionEncoderDecoderModel", "--input", "pixel_values=float[B,3,32,32]"), 3)
    assert "fed the model" not in line  # the inputs were the user's
    from fxacct.load.source import guessed_input_note

    bad = fxacct.Config(target=f"hf:{tmp_path / 'ved64'}", hf_class="VisionEncoderDecoderModel", batch=2)
    model, _, _, _ = load_model(bad)
    assert guessed_input_note(bad, model) == (
        "fxacct fed the model its default input (--input 'pixel_values=float32[B,3,64,64]' "
        "--input 'decoder_input_ids=int64[B,32]<64'); if the model takes another, give --input")


@pytest.mark.parametrize("model, fragments", [
    ("nosuchpackage_xyz.models:Net", ("no module named 'nosuchpackage_xyz'",)),
    ("torchvision_not_here.models:resnet50", ("no module named",)),
    ("torch.nn:Lineer", ("torch.nn has no name 'Lineer'", "Linear")),
    ("torch.nn:functional", ("is a module, not an nn.Module",)),
    ("torch:Tensor", ("the class Tensor, not an nn.Module",)),
    ("transformers:LlamaForCausalLM", ("-k config=PATH",)),
])
def test_bad_module_paths_are_one_line_usage_errors(model, fragments):
    if model.startswith("transformers"):
        pytest.importorskip("transformers")
    assert_one_line_error(invoke("profile", model), 2, *fragments)


def test_bad_hf_configs_are_one_line_usage_errors(tmp_path, llama_json):
    unknown = _write(tmp_path, "unknown.json", {"model_type": "no_such_arch", "hidden_size": 8})
    assert_one_line_error(invoke("profile", f"hf:{unknown}"), 2, "model_type 'no_such_arch' is unknown")
    assert_one_line_error(invoke("profile", f"hf:{tmp_path / 'missing'}"), 2, "no hugging face config")
    assert_one_line_error(invoke("profile", f"hf:{llama_json}", "-k", "hiden_size=8"), 2, "no field 'hiden_size'")
    assert_one_line_error(invoke("profile", f"hf:{llama_json}", "--hf-class", "Nope"), 2, "--hf-class 'Nope'")
    # a class of another family (it would fail inside transformers on a missing field: exit 3)
    assert_one_line_error(invoke("profile", f"hf:{llama_json}", "--hf-class", "BertModel"), 2,
                          "--hf-class BertModel builds from a BertConfig, and this config is a LlamaConfig")
    # an encoder-decoder config the default causal-LM class cannot build: the seq2seq class is offered
    t5 = _write(tmp_path, "t5.json", dict(model_type="t5", vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                          num_heads=2))
    assert_one_line_error(invoke("profile", f"hf:{t5}"), 2, "--hf-class (e.g. AutoModelForSeq2SeqLM")
    assert_one_line_error(invoke("profile", target("examples/two_layer.py:TwoLayer"), "--seq-len", "8"), 2,
                          "--seq-len")
    assert_one_line_error(invoke("profile", target("examples/two_layer.py:TwoLayer"), "--hf-class", "AutoModel"),
                          2, "--hf-class")


def test_loss_flag_is_checked():
    result = invoke("profile", target("examples/two_layer.py:TwoLayer"), "--loss", "hinge")
    assert result.exit_code == 2


def test_runtime_builds_the_same_model_for_all_three_forms(llama_json):
    from fxacct.runtime.build import build_model, make_inputs

    cpu = torch.device("cpu")
    configs = [
        fxacct.Config(target=target("examples/gpt2.py:GPT"), batch=2,
                      kwargs=dict(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8)),
        fxacct.Config(target="torch.nn:TransformerEncoderLayer", batch=2,
                      kwargs=dict(d_model=16, nhead=2, batch_first=True),
                      inputs=(fxacct.load.inputs.parse_input_spec("float[B,8,16]"),)),
        fxacct.Config(target=f"hf:{llama_json}", batch=2, seq_len=8, loss="cross-entropy"),
    ]
    for cfg in configs:
        meta, args, kwargs, _ = load_model(cfg)
        real, source = build_model(cfg, cpu)
        assert type(real) is type(meta)
        assert [(n, p.shape, p.dtype) for n, p in real.named_parameters()] == \
            [(n, p.shape, p.dtype) for n, p in meta.named_parameters()]
        assert all(p.device.type == "cpu" for p in real.parameters())
        r_args, r_kwargs = make_inputs(cfg, real, source, cpu)
        shapes = lambda a, k: ([tuple(x.shape) for x in a], {n: tuple(x.shape) for n, x in k.items()})  # noqa: E731
        assert shapes(r_args, r_kwargs) == shapes(args, kwargs)


@pytest.mark.slow  # real runs; test_runtime_cpu stays fast
def test_runtime_op_level_peak_equals_the_account_with_cross_entropy(llama_json):
    from fxacct.runtime.run import measure

    cfg = fxacct.Config(target=f"hf:{llama_json}", batch=2, seq_len=16, loss="cross-entropy")
    predicted = fxacct.profile(cfg).memory.peak_train.bytes
    m = measure(cfg, torch.device("cpu"), steps=1, warmup=1)
    assert m.op_level_peak_bytes == predicted


def test_module_path_detection():
    from fxacct.load.source import is_module_path

    assert is_module_path("torch.nn:Linear") and is_module_path("timm:create_model")
    assert not is_module_path("examples/gpt2.py:GPT") and not is_module_path("model.py:Net")
    assert not is_module_path("hf:/tmp/x")
    with pytest.raises(UsageError):
        fxacct.profile(fxacct.Config(target="torch.nn:Linear", kwargs={"in_features": 2}))  # needs out_features


def test_a_module_in_the_working_directory_imports(tmp_path, monkeypatch):
    (tmp_path / "fxacct_test_cwd_net.py").write_text(
        "import torch\n\nclass Net(torch.nn.Linear):\n    def __init__(self):\n        super().__init__(3, 2)\n")
    monkeypatch.chdir(tmp_path)
    # one Linear 3 -> 2 at batch 5: forward 2·5·3·2 = 60 (matmul) FLOPs
    doc = profile_json("fxacct_test_cwd_net:Net", "--input", "float[B,3]", "--batch", "5")
    assert doc["totals"]["forward_flops_by_class"]["matmul"] == 60


def test_a_torch_kernel_refusing_the_model_is_a_model_error(tmp_path):
    # Mixtral's default experts kernel, grouped_mm, has a fake kernel for bfloat16 only: in float32 the
    # model's own statement (in transformers) raises inside fxacct's dispatch modes, which pass it through:
    # exit 3 naming the kernel and both ways out, not an internal error (exit 4)
    pytest.importorskip("transformers")
    moe = _write(tmp_path, "moe.json", dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=64,
                                            hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=2))
    assert_one_line_error(invoke("profile", f"hf:{moe}", "--seq-len", "8"), 3, "the model's forward runs grouped_mm",
                          "--dtype bf16", "experts_implementation=batched_mm")
    assert invoke("profile", f"hf:{moe}", "--seq-len", "8", "--dtype", "bf16", "--summary").exit_code == 0


def test_a_seq_len_past_learned_positions_is_named_as_the_cause(tmp_path, llama_json):
    """BERT's position table has max_position_embeddings rows: a longer --seq-len fails inside
    transformers (exit 3), and the line says which flag passed which limit. A rotary model (Llama)
    has no such table and runs past its max_position_embeddings, so nothing is refused up front."""
    bert = _write(tmp_path, "bert.json", dict(model_type="bert", architectures=["BertForMaskedLM"], vocab_size=64,
                                              hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                              intermediate_size=64, max_position_embeddings=16))
    assert_one_line_error(invoke("profile", f"hf:{bert}", "--seq-len", "32"), 3,
                          "--seq-len 32 is longer than BertForMaskedLM's max_position_embeddings (16)")
    assert invoke("profile", f"hf:{bert}", "--seq-len", "16", "--summary").exit_code == 0
    # GPT-2 looks its positions up at arange(T), whose values fxacct knows: past the table it failed
    # in eager only, and the account said nothing (exit 0)
    gpt2 = _write(tmp_path, "gpt2.json", dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=64,
                                              n_embd=32, n_layer=1, n_head=4, n_positions=16))
    assert_one_line_error(invoke("profile", f"hf:{gpt2}", "--seq-len", "32"), 3, "index out of range in self")
    positions = json.loads(llama_json.read_text())["max_position_embeddings"]
    assert invoke("profile", f"hf:{llama_json}", "--seq-len", str(2 * positions), "--summary").exit_code == 0


def test_the_report_names_the_class_built_where_the_target_does_not(tmp_path):
    """A config without ``architectures`` builds AutoModelForCausalLM's choice: the summary, the
    markdown and the JSON name it (LlamaForCausalLM for model_type llama, transformers' own
    MODEL_FOR_CAUSAL_LM_MAPPING), under --mesh too, where FSDP2 renames the class it wraps
    (FSDPLlamaForCausalLM); a target that names its class is not repeated."""
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from fxacct_cli.main import cli

    no_arch = _write(tmp_path, "plain.json", {k: v for k, v in TINY_LLAMA.items() if k != "architectures"})
    hf = ["profile", f"hf:{no_arch}", "--batch", "2", "--seq-len", "8"]
    for extra, first_line in (([], "fxacct profile: hf:{} (LlamaForCausalLM)"),
                              (["--format", "markdown"], "### fxacct profile: `hf:{} (LlamaForCausalLM)`"),
                              (["--mesh", "fsdp=2"], "fxacct profile: hf:{} (LlamaForCausalLM)")):
        result = CliRunner().invoke(cli, hf + extra)
        assert result.exit_code == 0, result.output
        assert result.output.splitlines()[0] == first_line.format(no_arch)
    assert profile_json(f"hf:{no_arch}", "--batch", "2", "--seq-len", "8")["model_class"] == "LlamaForCausalLM"
    layer = ["torch.nn:TransformerEncoderLayer", "-k", "d_model=16", "-k", "nhead=2", "--input", "float[B,4,16]"]
    assert profile_json(*layer)["model_class"] == "TransformerEncoderLayer"
    text = CliRunner().invoke(cli, ["profile", *layer]).output
    assert text.splitlines()[0] == "fxacct profile: torch.nn:TransformerEncoderLayer"


def test_an_hf_profile_writes_nothing_of_torchao_to_stderr(tmp_path):
    """transformers' modeling classes import torchao wherever it is installed, and torchao logs a
    warning for each CUDA extension a CPU-only machine cannot load, plus torch's notices of its enums
    (four lines, on every hf: profile, that read as errors); fxacct quiets them as --fp8's import does.
    A fresh process: an import done earlier in this one would log nothing to catch."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(tmp_path / "llama")
    proc = subprocess.run([sys.executable, "-m", "fxacct_cli", "profile", f"hf:{tmp_path / 'llama'}", "--batch", "1",
                           "--summary"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr

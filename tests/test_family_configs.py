"""Model configs specdec cannot run exactly are refused at load with a message naming the
feature (and the CLI reports such a refusal in one line); configs whose features change
nothing run as plain Llama (docs/models.md). The families' shapes: families.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from families import make_config

from specdec.serving.arch import ArchConfig

# What cannot run exactly -> the words its refusal must contain.
REFUSED = {
    "yarn": ("llama2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                             "original_max_position_embeddings": 128}),
             "RoPE type 'yarn'"),
    "longrope": ("llama2", dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8, "original_max_position_embeddings": 128}),
        "RoPE type 'longrope'"),
    "partial_rotary": ("llama2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}),
                       "partial_rotary_factor"),
    "activation": ("llama2", dict(hidden_act="gelu"), "activation 'gelu'"),
    "bidirectional": ("gemma3", dict(use_bidirectional_attention=True),
                      "use_bidirectional_attention"),
    "gemma3_attn_softcap": ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "layer_type": ("qwen2", dict(layer_types=["chunked_attention", "full_attention"]),
                   "layer type 'chunked_attention'"),
    "local_rope_scaling": ("gemma3", dict(rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
        "RoPE type 'linear' on sliding-window layers"),
    "quantized": ("llama2", dict(quantization_config={"quant_method": "gptq", "bits": 4}),
                  "quantization_config"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_configs_that_cannot_run_exactly_are_refused_naming_the_feature(case):
    family, overrides, words = REFUSED[case]
    config, _ = make_config(family, **overrides)
    with pytest.raises(ValueError) as err:
        ArchConfig.from_hf(config)
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("cls, words", [
    ("Gemma3Config", "'gemma3' is not supported (a multimodal Gemma 3"),
    ("Qwen2MoeConfig", "'qwen2_moe' is not supported (mixture-of-experts"),
    ("Phi3Config", "'phi3' is not supported"),
    ("GPT2Config", "'gpt2' is not supported"),
])
def test_other_model_types_are_refused_naming_the_type(cls, words):
    import transformers

    with pytest.raises(ValueError, match="supported") as err:
        ArchConfig.from_hf(getattr(transformers, cls)())
    assert words in str(err.value)


def test_what_changes_nothing_runs_as_plain_llama():
    """A window as long as the context masks nothing; a dynamic RoPE is transformers' default
    one until a sequence outgrows max_position_embeddings, which the engine refuses anyway
    (its test above checks the frequencies bit for bit); biases are weights, not features."""
    mistral, _ = make_config("mistral", sliding_window=512)
    arch = ArchConfig.from_hf(mistral)
    assert arch.sliding_window is None and arch.layer_types is None
    assert ArchConfig.from_hf(make_config("llama2")[0]).features() == []
    assert ArchConfig.from_hf(make_config("qwen2")[0]).features() == []
    llama3 = ArchConfig.from_hf(make_config("llama3")[0])
    assert llama3.features() == ["rope_scaling"]
    # Draft files written before these features existed load as the plain Llama they are.
    fields = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rms_norm_eps", "rope_theta", "max_context")
    old = ArchConfig(**{f: getattr(llama3, f) for f in fields})
    assert old.features() == [] and old.rope_scaling is None
    # ... and ones written now round-trip through JSON.
    import dataclasses

    assert ArchConfig(**json.loads(json.dumps(dataclasses.asdict(llama3)))) == llama3
    gemma3 = ArchConfig.from_hf(make_config("gemma3")[0])
    assert ArchConfig(**json.loads(json.dumps(dataclasses.asdict(gemma3)))) == gemma3


def test_the_trainable_draft_refuses_what_it_does_not_model():
    from specdec.models.draft_model import DraftModule

    vocab = torch.arange(10)
    DraftModule(ArchConfig.from_hf(make_config("llama3")[0]), torch.zeros(100, 64), vocab)
    with pytest.raises(ValueError, match="qk_norm"):
        DraftModule(ArchConfig.from_hf(make_config("qwen3")[0]), torch.zeros(100, 64), vocab)


@pytest.fixture(scope="module")
def refused_dir(tmp_path_factory):
    """A saved tiny Llama whose config asks for YaRN RoPE."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("refused") / "yarn"
    config, tok = make_config("llama2", num_hidden_layers=1, **REFUSED["yarn"][1])
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("command", [
    ["generate", "hello", "--max-new-tokens", "2"],
    ["serve", "--port", "0"],
])
def test_the_cli_reports_a_refused_model_in_one_line(refused_dir, command):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *command, "--target", refused_dir,
         "--draft", "ngram"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: target service cannot load"), lines[0]
    assert "RoPE type 'yarn' is not supported" in lines[0]
    assert out.stdout == ""

"""Loading a sharded safetensors checkpoint shard by shard (specdec.models.checkpoint, issue 37).

The engine a checkpoint loads into computes transformers' logits bit for bit as the engine built
from transformers' own model does, in float32 and in bfloat16; the host's peak memory while a
~1B-wide random model loads stays within 1.2x its weight bytes, where reading the whole state
dict first (the mutant) exceeds it; a draft pairs with a sharded target.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from specdec.models.checkpoint import checkpoint_files, load_weights, read_tensor
from specdec.serving.arch import ArchConfig, canonical_weights
from specdec.serving.engine import LlamaEngine

VOCAB = 1024


def save_sharded(path, cls: str, seed: int = 0, shard: str = "100KB", **kwargs):
    """A small random-weight model of a transformers config class, saved in shards of
    ``shard``; returns (path, model)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, cls)(vocab_size=VOCAB, max_position_embeddings=256,
                                        num_hidden_layers=2, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their 1 / 0 init
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(path, max_shard_size=shard)
    return str(path), model


MODELS = {
    "llama_untied_biases": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_sharded_checkpoint_loads_the_engine_transformers_model_makes(tmp_path, name, dtype):
    cls, kwargs = MODELS[name]
    path, model = save_sharded(tmp_path / name, cls, **kwargs)
    assert len(checkpoint_files(path)) > 2  # really sharded
    model = model.to(dtype)
    arch = ArchConfig.from_hf(model.config)
    weights = load_weights(path, arch, "cpu", dtype)
    reference = canonical_weights(model.state_dict(), arch)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():  # (Gemma's 1 + w float32 in both)
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key
    if model.config.tie_word_embeddings:
        assert weights["head"] is weights["embed"]  # one tensor, not two copies
    loaded = LlamaEngine.from_checkpoint(path, kernels="mkl", dtype=dtype)
    built = LlamaEngine.from_hf(model, kernels="mkl", dtype=dtype)
    ids = torch.arange(30) * 37 % VOCAB
    out = [e.forward([e.new_cache()], [ids], [30])[0] for e in (loaded, built)]
    assert torch.equal(out[0], out[1]), name
    if dtype == torch.float32:
        with torch.no_grad():
            ref = model(ids[None]).logits[0]
        assert float((out[0] - ref).abs().max()) < 1e-4 * max(1.0, float(ref.abs().max()))


def test_a_missing_tensor_is_named(tmp_path):
    cls, kwargs = MODELS["llama_untied_biases"]
    path, model = save_sharded(tmp_path / "m", cls, **kwargs)
    arch = ArchConfig.from_hf(model.config)
    index = tmp_path / "m" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "m" / shard))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(tmp_path / "m" / shard), metadata={"format": "pt"})
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks model.layers.1.mlp.up_proj.weight"):
        load_weights(path, arch, "cpu", torch.float32)
    assert read_tensor(path, ("nope", "lm_head.weight")).shape == (VOCAB, 64)


# A Llama 3.2 1B's widths (hidden 2048 there: 768 here, with its 4:1 GQA and 4x MLP), few
# layers and a small vocabulary: ~170 MB of bfloat16 in 10 MB shards, written directly.
BIG = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
           num_key_value_heads=3, num_hidden_layers=8, vocab_size=8192,
           max_position_embeddings=256, tie_word_embeddings=False)
PEAK = 1.2  # host memory while loading, at most this many times the weights' bytes

MEASURE = r"""
import json, sys
import torch
from transformers import AutoConfig
from specdec.serving.engine import LlamaEngine

def status(field):  # kB -> bytes; VmHWM is this process's own peak (ru_maxrss survives exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

mode, path = sys.argv[1], sys.argv[2]
AutoConfig.from_pretrained(path)  # before the baseline: transformers' imports (~150 MB)
try:  # start the peak from here (Linux >= 4.0), not from the imports' transients
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = status("VmRSS")
if mode == "sharded":
    engine = LlamaEngine.from_checkpoint(path, kernels="mkl", dtype=torch.bfloat16)
else:  # the mutant: the whole state dict in memory first (copied out of the mapped files, as
    # transformers' from_pretrained holds it), then the engine's layout
    from safetensors.torch import load_file
    from specdec.models.checkpoint import checkpoint_files
    from specdec.serving.arch import ArchConfig, canonical_weights
    state = {}
    for f in checkpoint_files(path):
        state.update({k: v.clone() for k, v in load_file(str(f)).items()})
    arch = ArchConfig.from_hf(AutoConfig.from_pretrained(path))
    engine = LlamaEngine(arch, canonical_weights(state, arch), kernels="mkl",
                         dtype=torch.bfloat16)
peak = status("VmHWM")
weights = sum(t.numel() * t.element_size() for t in [engine.embed, engine.norm]
              + [engine.head.plain] + [v.plain if hasattr(v, "plain") else v
                                       for layer in engine.layers for v in layer.values()])
print(json.dumps(dict(base=base, peak=peak, weights=weights)))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A sharded bf16 checkpoint of BIG's shape, random weights, written shard by shard."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("big")
    config = LlamaConfig(**BIG)
    config.save_pretrained(path)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       a + "q_proj.weight": (h, h), a + "k_proj.weight": (kv, h),
                       a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, h),
                       m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h),
                       m + "down_proj.weight": (h, i)})
    gen = torch.Generator().manual_seed(0)
    shards, current, size, limit = [], {}, 0, 10 << 20
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if current and size + t.numel() * 2 > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * 2
    shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(path)


def measure(mode: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, mode, path], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_holds_the_weights_about_once_where_reading_all_first_holds_them_twice(
        big_checkpoint):
    sharded = measure("sharded", big_checkpoint)
    mutant = measure("whole-state-dict", big_checkpoint)
    for r in (sharded, mutant):
        r["ratio"] = (r["peak"] - r["base"]) / r["weights"]
    print(f"weights {sharded['weights'] / 2**20:.0f} MiB: peak host memory while loading "
          f"{sharded['ratio']:.2f}x shard by shard, {mutant['ratio']:.2f}x reading all first")
    assert sharded["weights"] == mutant["weights"] > 150 << 20
    assert sharded["ratio"] < PEAK < mutant["ratio"], (sharded, mutant)

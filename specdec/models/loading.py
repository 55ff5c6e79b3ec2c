"""Build a service's runtime from a model spec: load weights, tokenizer, fingerprint, engine."""

from __future__ import annotations

import logging

import torch

from specdec.config import DEFAULT_NUMERICS, INT8, ServiceConfig, split_quantization
from specdec.models.checkpoint import checkpoint_files
from specdec.models.hub import (gguf_file, load_hf_model, pick_device, pick_dtype,
                                resolve_model_dir)
from specdec.models.tokenizer import eos_token_ids, fingerprint
from specdec.serving.arch import ArchConfig
from specdec.serving.engine import LlamaEngine
from specdec.serving.runtime import DraftRuntime, ServiceInfo, TargetRuntime

log = logging.getLogger(__name__)

NGRAM = "ngram"
DEFAULT_DRAFT = "default-draft"


def _set_threads(config: ServiceConfig) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)


def load_engine(spec: str, device: torch.device, kernels: str = "auto",
                numerics: str = DEFAULT_NUMERICS, dtype: torch.dtype | None = None):
    """(engine, tokenizer, hf_config) for a Hugging Face / GGUF / default / draft-directory
    model spec, quantized when it says so ("int8:<spec>"), in ``numerics`` (config.NUMERICS)
    and ``dtype`` (None: the engine's default for the device)."""
    from specdec.models import draft_model

    quantize, spec = split_quantization(spec)
    if draft_model.is_draft_dir(spec):
        return draft_model.load_engine(spec, device, kernels, quantize=quantize,
                                       numerics=numerics, dtype=dtype)
    check_architecture(spec)  # refuse before reading any weights
    path = resolve_model_dir(spec)
    if checkpoint_files(path):  # shard by shard onto the device, in its dtype
        from transformers import AutoConfig, AutoTokenizer

        engine = LlamaEngine.from_checkpoint(path, device, kernels, quantize=quantize,
                                             gguf=gguf_file(spec), numerics=numerics,
                                             dtype=dtype)
        return engine, AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    model, tokenizer = load_hf_model(spec)  # (a pytorch_model.bin: transformers reads it)
    engine = LlamaEngine.from_hf(model, device, kernels, quantize=quantize, gguf=gguf_file(spec),
                                 numerics=numerics, dtype=dtype)
    return engine, tokenizer, model.config


def load_draft_engine(spec: str, device: torch.device, kernels: str = "auto",
                      numerics: str = DEFAULT_NUMERICS, dtype: torch.dtype | None = None):
    """``load_engine``, and for a feature-conditioned draft directory (EAGLE-style: it reads
    the target's features) its ``FeatureEngine`` with its target's tokenizer (hf_config None)."""
    from specdec.models import draft_model

    if not draft_model.is_feature_draft(spec):
        return load_engine(spec, device, kernels, numerics, dtype)
    from specdec.models.hub import load_tokenizer
    from specdec.serving.feature_engine import FeatureEngine

    engine = FeatureEngine.load(spec, device, kernels, numerics, dtype)
    return engine, load_tokenizer(draft_model.read_meta(spec)["target"]), None


def check_architecture(spec: str) -> ArchConfig:
    """The engine's architecture for a Hugging Face / GGUF / default model spec, from its
    config.json alone; ValueError naming what specdec cannot run exactly (never approximately)."""
    from transformers import AutoConfig

    return ArchConfig.from_hf(AutoConfig.from_pretrained(resolve_model_dir(spec)))


def build_target(config: ServiceConfig) -> TargetRuntime:
    _set_threads(config)
    device = pick_device(config.device)
    engine, tokenizer, hf_config = load_engine(config.model, device, config.kernels,
                                               config.numerics, pick_dtype(config.dtype, device))
    return TargetRuntime(config, _model_info(config, engine, tokenizer, hf_config), engine,
                         tokenizer)


def _model_info(config: ServiceConfig, engine, tokenizer, hf_config) -> ServiceInfo:
    """What GetInfo reports for a model service (costs are measured by the runtime)."""
    return ServiceInfo(
        model=config.model,
        role=config.role,
        tokenizer_fingerprint=fingerprint(tokenizer),
        vocab_size=engine.vocab_in,
        max_context=engine.arch.max_context,
        eos_token_ids=eos_token_ids(tokenizer, hf_config),
        forward_ms=[],
        numerics=engine.numerics,
        features=getattr(engine, "reads_features", False),
        feature_dim=engine.feature_width if getattr(engine, "reads_features", False) else
        engine.arch.hidden_size if config.role == "target" else 0,
        feature_layers=list(getattr(engine, "feature_layers", ())),
    )


def resolve_draft_spec(spec: str, target: str) -> str:
    """The draft spec to load: ``default-draft`` is the shipped draft for the default target,
    and for any other the target's own int8 copy (``int8:<target>``: ~0.95 of the default
    target's greedy tokens at about half its CPU forward, where the target itself, the fallback
    before, drafted at its full cost); ``int8:default-draft`` the shipped draft's int8 copy."""
    from specdec.models import draft_model
    from specdec.models.hub import is_default_target

    quantize, inner = split_quantization(spec)
    if quantize is not None:
        return f"{quantize}:{resolve_draft_spec(inner, target)}"
    if spec != DEFAULT_DRAFT:
        return spec
    shipped = draft_model.shipped_draft_dir()
    if shipped is not None and is_default_target(target):
        return str(shipped)
    log.warning("no shipped draft for target %r: drafting with its int8 copy (int8:%s)",
                target, target)
    return f"{INT8}:{target}"


def build_draft(config: ServiceConfig, target: str = "default", q_top_k: int = 64) -> DraftRuntime:
    _set_threads(config)
    spec = resolve_draft_spec(config.model, target)
    if spec == NGRAM:
        from specdec.models.hub import load_tokenizer

        tokenizer = load_tokenizer(target)
        info = ServiceInfo(
            model=NGRAM,
            role="draft",
            tokenizer_fingerprint=fingerprint(tokenizer),
            vocab_size=len(tokenizer),
            max_context=1 << 20,
            eos_token_ids=eos_token_ids(tokenizer),
            forward_ms=[0.0],
            drafter="ngram",
        )
        return DraftRuntime(config, info, None, tokenizer=tokenizer)
    device = pick_device(config.device)
    engine, tokenizer, hf_config = load_draft_engine(spec, device, config.kernels,
                                                     config.numerics,
                                                     pick_dtype(config.dtype, device))
    return DraftRuntime(config, _model_info(config, engine, tokenizer, hf_config), engine,
                        q_top_k=q_top_k, tokenizer=tokenizer)


__all__ = ["build_target", "build_draft", "load_engine", "load_draft_engine", "resolve_model_dir",
           "split_quantization", "NGRAM", "DEFAULT_DRAFT", "INT8"]

"""The engine dtype as a service setting (issue 37): validated once in ServiceConfig, chosen per
device by "auto", passed from the command lines to both services, refused in words when bad."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from specdec.config import DTYPES, ServiceConfig
from specdec.models.hub import pick_dtype
from specdec.rpc.service_main import add_service_arguments, service_config_from_args


def test_auto_is_bf16_on_cuda_and_float32_on_cpu():
    assert pick_dtype("auto", "cpu") == torch.float32
    assert pick_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert [pick_dtype(d, "cpu") for d in DTYPES[1:]] == [torch.float32, torch.bfloat16,
                                                          torch.float16]


@pytest.mark.parametrize("bad", ["fp8", "bf16", "", "float64"])
def test_a_bad_dtype_is_refused_in_words(bad):
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        ServiceConfig(dtype=bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        pick_dtype(bad, "cpu")


def test_the_service_flag_reaches_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_service_arguments(parser, "default")
    assert service_config_from_args(parser.parse_args([]), "target").dtype == "auto"
    args = parser.parse_args(["--dtype", "bfloat16"])
    assert service_config_from_args(args, "draft").dtype == "bfloat16"


@pytest.mark.parametrize("command", [
    ["orchestrator.cli", "generate", "hi"],
    ["orchestrator.cli", "serve"],
    ["target_service"],
    ["draft_service"],
])
def test_the_command_lines_refuse_a_bad_dtype_before_loading_anything(command):
    out = subprocess.run([sys.executable, "-m", *command, "--dtype", "fp8"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--dtype" in out.stderr and "invalid choice: 'fp8'" in out.stderr, out.stderr[-2000:]


def test_a_bf16_engine_refuses_float32_only_kernels():
    from specdec.serving.arch import ArchConfig
    from specdec.serving.engine import LlamaEngine

    arch = ArchConfig(hidden_size=8, num_layers=0, num_heads=2, num_kv_heads=1, head_dim=4,
                      intermediate_size=16, rms_norm_eps=1e-5, rope_theta=1e4, max_context=64)
    weights = {"embed": torch.randn(10, 8), "norm": torch.ones(8), "head": torch.randn(10, 8)}
    engine = LlamaEngine(arch, weights, kernels="auto", dtype=torch.bfloat16)
    assert engine.kernels is None and engine.head.plain.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="runs float32 on CPU"):
        LlamaEngine(arch, weights, kernels="smallm", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be"):
        LlamaEngine(arch, weights, dtype=torch.float64)

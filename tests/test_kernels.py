"""CPU linear kernels: the same product on either kernel, the faster kept per shape, and the
model thread as the process's only lasting torch thread."""

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F

from orchestrator.local import ServiceProcess, service_args, shared_cores_env
from specdec.rpc.host import in_passing_thread
from specdec.serving.kernels import (
    MKL,
    ONEDNN,
    KernelPlan,
    Linear,
    choose_kernels,
    prepack_available,
)

needs_onednn = pytest.mark.skipif(not prepack_available(torch.device("cpu")),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("one, block", [(MKL, MKL), (MKL, ONEDNN), (ONEDNN, MKL),
                                        (ONEDNN, ONEDNN)])
def test_every_plan_computes_the_same_product(one, block):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    lin = Linear(w, b, KernelPlan(one, block))
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _fake_timer(ms: dict):
    """forward_ms(rows) for a plan: reads which kernel the plan currently names for rows."""
    def forward_ms(plan):
        return lambda rows: ms[(plan.kernel(rows), rows)]
    return forward_ms


@needs_onednn
@pytest.mark.parametrize("ms, want", [
    ({(MKL, 1): 27.0, (ONEDNN, 1): 33.0, (MKL, 5): 60.0, (ONEDNN, 5): 38.0}, (MKL, ONEDNN)),
    ({(MKL, 1): 49.0, (ONEDNN, 1): 30.0, (MKL, 5): 61.0, (ONEDNN, 5): 29.0}, (ONEDNN, ONEDNN)),
    ({(MKL, 1): 20.0, (ONEDNN, 1): 30.0, (MKL, 5): 21.0, (ONEDNN, 5): 29.0}, (MKL, MKL)),
])
def test_the_faster_kernel_is_kept_per_shape_and_unused_layouts_are_freed(ms, want):
    plan = KernelPlan()
    lins = [Linear(torch.randn(8, 8), None, plan) for _ in range(3)]
    choose_kernels(plan, lins, _fake_timer(ms)(plan), reps=2)
    assert (plan.one, plan.block) == want
    for lin in lins:
        assert (lin.plain is not None) == (MKL in want)
        assert (lin.packed is not None) == (ONEDNN in want)
        x = torch.randn(1, 8)
        torch.testing.assert_close(lin(x), x @ lin_weight(lin).T, rtol=1e-5, atol=1e-5)


def lin_weight(lin: Linear) -> torch.Tensor:
    if lin.plain is not None:
        return lin.plain
    return torch.ops.mkldnn._linear_pointwise(torch.eye(lin.in_features), lin.packed, None,
                                              "none", [], "").T


def test_an_engine_refuses_an_unknown_kernel_choice(tiny_models):
    from specdec.models.loading import load_engine

    with pytest.raises(ValueError, match="kernels must be one of"):
        load_engine(tiny_models["target"], torch.device("cpu"), "fast")


def test_the_loader_runs_in_a_thread_that_has_ended_when_it_returns():
    seen = {}

    def load(x):
        seen["thread"] = threading.current_thread()
        return x * 2

    async def go():
        assert await in_passing_thread(load, 21) == 42

    asyncio.run(go())
    assert seen["thread"] is not threading.main_thread()
    seen["thread"].join(timeout=5)
    assert not seen["thread"].is_alive()


def test_the_loader_thread_passes_errors_on():
    def fail():
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        asyncio.run(in_passing_thread(fail))


def test_services_sharing_the_cores_spin_less_unless_the_user_says(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert shared_cores_env() == {"GOMP_SPINCOUNT": "100000"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert shared_cores_env() == {}


def test_local_service_processes_get_that_environment(tiny_models, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    service = ServiceProcess("target", service_args(tiny_models["target"], 1, ["--no-calibrate"]))
    try:
        environ = open(f"/proc/{service.proc.pid}/environ", "rb").read().split(b"\0")
        assert b"GOMP_SPINCOUNT=100000" in environ
    finally:
        service.stop()

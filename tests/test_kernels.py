"""CPU linear kernels: the same product on either kernel, the faster kept per shape, and the
model thread as the process's only lasting torch thread."""

import asyncio
import re
import threading

import pytest
import torch
import torch.nn.functional as F

from orchestrator.local import ServiceProcess, service_args, shared_cores_env
from specdec.rpc.host import in_passing_thread
from specdec.serving.kernels import (
    MKL,
    MKL_T,
    ONEDNN,
    KernelPlan,
    Linear,
    choose_kernels,
    prepack_available,
)

needs_onednn = pytest.mark.skipif(not prepack_available(torch.device("cpu")),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("one", [MKL, MKL_T, ONEDNN])
@pytest.mark.parametrize("block", [MKL, MKL_T, ONEDNN])
@pytest.mark.parametrize("bias", [True, False])
def test_every_plan_computes_the_same_product(one, block, bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    lin = Linear(w, b, KernelPlan(one, block))
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # only the layouts the plan's kernels read are kept
    assert (lin.plain is not None) == (MKL in (one, block))
    assert (lin.transposed is not None) == (MKL_T in (one, block))
    assert (lin.packed is not None) == (ONEDNN in (one, block))


def _fake_timer(ms: dict):
    """forward_ms(rows) for a plan: reads which kernel the plan currently names for rows."""
    def forward_ms(plan):
        return lambda rows: ms[(plan.kernel(rows), rows)]
    return forward_ms


def _times(one: tuple[float, float, float], five: tuple[float, float, float]) -> dict:
    """Fake forward ms of (mkl, mkl-t, onednn) for 1 and 5 rows."""
    return {**{(k, 1): v for k, v in zip((MKL, MKL_T, ONEDNN), one)},
            **{(k, 5): v for k, v in zip((MKL, MKL_T, ONEDNN), five)}}


@needs_onednn
@pytest.mark.parametrize("ms, want", [
    # the AVX2 EPYC's order in a slow hour: mkl-t for one row, oneDNN for blocks
    (_times((72.7, 54.4, 80.3), (142.6, 151.0, 106.2)), (MKL_T, ONEDNN)),
    (_times((27.0, 31.0, 33.0), (60.0, 70.0, 38.0)), (MKL, ONEDNN)),
    (_times((49.0, 52.0, 30.0), (61.0, 80.0, 29.0)), (ONEDNN, ONEDNN)),
    (_times((20.0, 25.0, 30.0), (21.0, 40.0, 29.0)), (MKL, MKL)),
    (_times((40.0, 20.0, 30.0), (61.0, 25.0, 29.0)), (MKL_T, MKL_T)),
])
def test_the_fastest_kernel_is_kept_per_shape_and_unused_layouts_are_freed(ms, want):
    plan = KernelPlan(trying=(MKL, MKL_T, ONEDNN))
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(8, 8, generator=gen) for _ in range(3)]
    lins = [Linear(w, None, plan) for w in weights]
    assert all(lin.plain is not None and lin.transposed is not None and lin.packed is not None
               for lin in lins)  # every candidate's layout while it is measured
    choose_kernels(plan, lins, _fake_timer(ms)(plan), reps=2)
    assert (plan.one, plan.block) == want
    assert plan.used() == set(want)
    for lin, w in zip(lins, weights):
        assert (lin.plain is not None) == (MKL in want)
        assert (lin.transposed is not None) == (MKL_T in want)
        assert (lin.packed is not None) == (ONEDNN in want)
        for rows in (1, 5):
            x = torch.randn(rows, 8, generator=gen)
            torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_an_engine_measures_every_kernel_and_keeps_one_per_shape(tiny_models, caplog):
    from specdec.models.loading import load_engine

    with caplog.at_level("INFO", logger="specdec.serving.kernels"):
        engine, _, _ = load_engine(tiny_models["target"], torch.device("cpu"), "auto")
    # "linear kernels: mkl-t for 1 row (mkl 93.4 / mkl-t 63.3 / onednn 111.9 ms), ..."
    message = next(r.getMessage() for r in caplog.records if "linear kernels" in r.getMessage())
    for listed in re.findall(r"\((.*?) ms\)", message):
        assert [part.split()[0] for part in listed.split(" / ")] == [MKL, MKL_T, ONEDNN]
    plan = engine.kernels
    assert plan.trying == ()
    assert {plan.one, plan.block} <= {MKL, MKL_T, ONEDNN}
    for lin in engine._linears():
        assert lin.plan is plan
        kept = {k for k, layout in ((MKL, lin.plain), (MKL_T, lin.transposed),
                                     (ONEDNN, lin.packed)) if layout is not None}
        assert kept == plan.used()


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

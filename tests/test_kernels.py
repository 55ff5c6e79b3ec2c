"""CPU linear kernels: the same product on either kernel, the faster kept per shape, and the
model thread as the process's only lasting torch thread."""

import asyncio
import re
import threading

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_SMALLM, needs_smallm
from orchestrator.local import SHARED_CORES_ENV, ServiceProcess, service_args, shared_cores_env
from specdec.rpc.host import in_passing_thread
from specdec.serving.kernels import (
    MKL,
    MKL_T,
    MEASURED_ROWS,
    ONEDNN,
    SMALLM,
    Int8Linear,
    KernelPlan,
    Linear,
    choose_kernels,
    prepack_available,
)

needs_onednn = pytest.mark.skipif(not prepack_available(torch.device("cpu")),
                                  reason="this torch build has no oneDNN")
ALL = [MKL, MKL_T, ONEDNN] + ([SMALLM] if HAS_SMALLM else [])


@needs_onednn
@pytest.mark.parametrize("one", ALL)
@pytest.mark.parametrize("block", ALL)
@pytest.mark.parametrize("bias", [True, False])
def test_every_plan_computes_the_same_product(one, block, bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    lin = Linear(w, b, KernelPlan(((1, one), (2, block), (4, one))))
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # only the layouts the plan's kernels read are kept
    assert (lin.plain is not None) == (MKL in (one, block))
    assert (lin.transposed is not None) == (MKL_T in (one, block))
    assert (lin.packed is not None) == (ONEDNN in (one, block))
    assert (lin.panels is not None) == (SMALLM in (one, block))


@needs_smallm
@pytest.mark.parametrize("out_features", [1, 15, 16, 37, 48, 64, 100, 576])
def test_smallm_computes_the_product_for_every_row_count_and_ragged_panels(out_features):
    """Every row count up to two chunks of 8 and output widths that leave 1..3 panels of a
    group and a partial last panel (the kernel's tails), with and without a bias."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 72, generator=gen)
    b = torch.randn(out_features, generator=gen)
    plain, biased = (Linear(w, bias, KernelPlan.fixed(SMALLM)) for bias in (None, b))
    for rows in range(1, 18):
        x = torch.randn(rows, 72, generator=gen)
        torch.testing.assert_close(plain(x), x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(biased(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    rows = torch.randn(3, 144, generator=gen)[:, ::2]  # a strided view: copied, not misread
    torch.testing.assert_close(plain(rows), rows @ w.T, rtol=1e-5, atol=1e-5)


@needs_smallm
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out_features", [256, 384, 600, 1000])
def test_smallm_splits_the_panels_between_torchs_threads(threads, out_features):
    """With torch's threads > 1 the panels are split between them in runs of 4 (the last
    share ragged, the last panel partial): the same product for every row count, with and
    without a bias, and the build here is the threaded one."""
    from specdec.serving.kernels import smallm_library

    lib, _ = smallm_library()
    assert lib.sd_threaded() == 1  # (gcc here has OpenMP)
    gen = torch.Generator().manual_seed(out_features + threads)
    w = torch.randn(out_features, 40, generator=gen)
    b = torch.randn(out_features, generator=gen)
    plain, biased = (Linear(w, bias, KernelPlan.fixed(SMALLM)) for bias in (None, b))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 5, 8, 9):
            x = torch.randn(rows, 40, generator=gen)
            torch.testing.assert_close(plain(x), x @ w.T, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(biased(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def _int8_reference(w: torch.Tensor) -> torch.Tensor:
    """The int8 weight, dequantized, computed apart: one symmetric scale per output row."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]


@needs_smallm
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out_features", [1, 15, 37, 100, 600])
def test_int8_layers_stream_int8_and_compute_their_dequantized_weights_product(threads,
                                                                              out_features):
    """smallm's int8 variant: the product with the dequantized weight (not with the float
    weight it came from) for every row count up to two chunks of 8, ragged panels and thread
    shares, an input width that is no multiple of 16, with and without a bias."""
    gen = torch.Generator().manual_seed(out_features + 10 * threads)
    w = torch.randn(out_features, 72, generator=gen)
    w[0, 5] = 9.0  # a row whose scale is set by one large weight
    b = torch.randn(out_features, generator=gen)
    deq = _int8_reference(w)
    assert (deq - w).abs().max() > 1e-3  # (the quantization is visible at this tolerance)
    plain, biased = Int8Linear(w, None), Int8Linear(w, b)
    assert plain.panels.dtype == torch.int8 and plain.plain is None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 18):
            x = torch.randn(rows, 72, generator=gen)
            torch.testing.assert_close(plain(x), x @ deq.T, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(biased(x), F.linear(x, deq, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_int8_layers_without_smallm_run_the_same_model_dequantized(monkeypatch):
    from specdec.serving import kernels

    monkeypatch.setattr(kernels, "smallm_available", lambda device: False)
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    lin = Int8Linear(w, b)
    assert lin.panels is None
    x = torch.randn(5, 24, generator=gen)
    torch.testing.assert_close(lin(x), F.linear(x, _int8_reference(w), b), rtol=1e-6, atol=1e-6)


def test_a_row_count_takes_the_kernel_of_the_last_pair_at_or_below_it():
    plan = KernelPlan(((4, ONEDNN), (1, MKL_T), (2, MKL), (3, MKL), (16, ONEDNN)))
    assert plan.chosen == ((1, MKL_T), (2, MKL), (4, ONEDNN))  # sorted, repeats merged
    assert [plan.kernel(m) for m in (1, 2, 3, 4, 5, 9, 16, 300)] == \
        [MKL_T, MKL, MKL, ONEDNN, ONEDNN, ONEDNN, ONEDNN, ONEDNN]
    assert plan.used() == {MKL_T, MKL, ONEDNN}
    assert plan.describe() == "mkl-t for 1 row, mkl for 2-3 rows, onednn for 4+ rows"
    assert KernelPlan.fixed(MKL).kernel(7) == MKL
    with pytest.raises(ValueError, match="starts at 1 row"):
        KernelPlan(((2, MKL),))


def _fake_timer(ms: dict):
    """forward_ms(rows) for a plan: reads which kernel the plan currently names for rows."""
    def forward_ms(plan):
        return lambda rows: ms[(plan.kernel(rows), rows)]
    return forward_ms


def _times(**by_kernel: tuple[float, ...]) -> dict:
    """Fake forward ms of each kernel at the measured row counts (1, 2, 3, 4, 6, 8, 16, 64)."""
    names = {"mkl": MKL, "mkl_t": MKL_T, "onednn": ONEDNN}
    return {(names[k], m): v for k, vs in by_kernel.items() for m, v in zip(MEASURED_ROWS, vs)}


@needs_onednn
@pytest.mark.parametrize("ms, want", [
    # the AVX-512 Xeon's order at one thread: mkl-t for one row, mkl for 2-3, oneDNN beyond
    (_times(mkl=(53.6, 52.1, 59.6, 83.5, 90.7, 116.6, 123.0, 154.0),
            mkl_t=(46.4, 67.4, 72.9, 78.2, 84.9, 99.4, 119.8, 137.0),
            onednn=(56.7, 60.4, 60.6, 60.4, 64.9, 72.3, 90.2, 130.0)),
     ((1, MKL_T), (2, MKL), (4, ONEDNN))),
    # the AVX2 EPYC's in a slow hour: mkl-t for one row, oneDNN for blocks
    (_times(mkl=(72.7, 120.0, 130.0, 140.0, 142.6, 150.0, 170.0, 260.0),
            mkl_t=(54.4, 81.0, 100.0, 140.0, 151.0, 160.0, 180.0, 270.0),
            onednn=(80.3, 91.0, 95.0, 100.0, 106.2, 110.0, 130.0, 230.0)),
     ((1, MKL_T), (2, MKL_T), (3, ONEDNN))),
    (_times(mkl=(20.0,) * 8, mkl_t=(25.0,) * 8, onednn=(30.0,) * 8), ((1, MKL),)),
    (_times(mkl=(40.0,) * 8, mkl_t=(20.0,) * 6 + (50.0, 50.0), onednn=(30.0,) * 8),
     ((1, MKL_T), (16, ONEDNN))),
    # a few-rows kernel fastest up to 16 rows, the libraries for a prefill chunk: the
    # 64-row probe hands rows past 63 to the library
    (_times(mkl=(40.0,) * 7 + (150.0,), mkl_t=(20.0,) * 7 + (140.0,),
            onednn=(30.0,) * 7 + (130.0,)),
     ((1, MKL_T), (64, ONEDNN))),
])
def test_the_fastest_kernel_is_kept_per_row_count_and_unused_layouts_are_freed(ms, want):
    plan = KernelPlan(trying=(MKL, MKL_T, ONEDNN))
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(8, 8, generator=gen) for _ in range(3)]
    lins = [Linear(w, None, plan) for w in weights]
    assert all(lin.plain is not None and lin.transposed is not None and lin.packed is not None
               for lin in lins)  # every candidate's layout while it is measured
    choose_kernels(plan, lins, _fake_timer(ms)(plan), reps=2)
    want = KernelPlan(want).chosen  # (merged)
    assert plan.chosen == want
    kept = {k for _, k in want}
    assert plan.used() == kept
    for lin, w in zip(lins, weights):
        assert (lin.plain is not None) == (MKL in kept)
        assert (lin.transposed is not None) == (MKL_T in kept)
        assert (lin.packed is not None) == (ONEDNN in kept)
        for rows in (1, 2, 3, 5, 20, 70):
            x = torch.randn(rows, 8, generator=gen)
            torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_an_engine_measures_every_kernel_and_keeps_one_per_row_count(tiny_models, caplog):
    from specdec.models.loading import load_engine

    with caplog.at_level("INFO", logger="specdec.serving.kernels"):
        engine, _, _ = load_engine(tiny_models["target"], torch.device("cpu"), "auto")
    # "linear kernels: mkl-t for 1 row, ... (ms per forward by rows, 1: mkl 93.4 / mkl-t 63.3
    # / onednn 111.9; 2: ...)"
    message = next(r.getMessage() for r in caplog.records if "linear kernels" in r.getMessage())
    measured = re.search(r"by rows, (.*)\)$", message).group(1).split("; ")
    assert [int(part.split(":")[0]) for part in measured] == list(MEASURED_ROWS)
    for part in measured:
        listed = part.split(": ", 1)[1]
        assert [k.split()[0] for k in listed.split(" / ")] == ALL
    plan = engine.kernels
    assert plan.trying == ()
    assert plan.used() <= set(ALL)
    assert plan.describe() in message
    for lin in engine._linears():
        assert lin.plan is plan
        kept = {k for k, layout in ((MKL, lin.plain), (MKL_T, lin.transposed),
                                     (ONEDNN, lin.packed), (SMALLM, lin.panels))
                if layout is not None}
        assert kept == plan.used()


def test_an_engine_refuses_an_unknown_kernel_choice(tiny_models):
    from specdec.models.loading import load_engine

    with pytest.raises(ValueError, match="kernels must be one of"):
        load_engine(tiny_models["target"], torch.device("cpu"), "fast")


def test_a_kernel_is_one_registry_entry(tiny_models, monkeypatch):
    """A kernel is declared once, in ``kernels.KERNELS``: the CLI's and the config's choices
    are read from it, and a new entry (here a test kernel on a layout of its own) is built by
    ``Linear``, freed by ``keep_only``, run by a fixed plan and timed by "auto" with no other
    edit. (Mutant: an engine that lists the kernels it tries by name leaves the new one
    out.)"""
    import argparse

    from specdec.config import ServiceConfig
    from specdec.models.loading import load_engine
    from specdec.rpc.service_main import add_service_arguments
    from specdec.serving import kernels as K

    assert K.KERNEL_CHOICES == ("auto",) + tuple(K.KERNELS)
    parser = argparse.ArgumentParser()
    add_service_arguments(parser, "default")
    parser_choices = next(a.choices for a in parser._actions if a.dest == "kernels")
    assert tuple(parser_choices) == K.KERNEL_CHOICES
    with pytest.raises(ValueError, match="kernels must be one of auto, mkl, mkl-t, onednn"):
        ServiceConfig(kernels="fast")
    calls = []

    def run(lin, x):
        calls.append(x.shape[0])
        return F.linear(x, lin.twice, lin.bias)

    twice = K.Kernel("twice", ("twice",),
                     lambda lin, codes, integer: setattr(lin, "twice", lin.plain.clone()),
                     run, lambda device: device.type == "cpu", "a CPU")
    monkeypatch.setitem(K.KERNELS, "twice", twice)
    monkeypatch.setattr(K.Linear, "twice", None, raising=False)
    weight, bias, x = torch.randn(24, 16), torch.randn(24), torch.randn(3, 16)
    lin = K.Linear(weight, bias, K.KernelPlan.fixed("twice"))
    assert lin.plain is None and lin.twice is not None  # its layout only
    assert torch.allclose(lin(x), F.linear(x, weight, bias), atol=1e-5) and calls == [3]
    both = K.Linear(weight, bias, K.KernelPlan(trying=("mkl", "twice")))
    both.keep_only({"mkl"})
    assert both.twice is None and both.plain is not None
    engine = load_engine(tiny_models["target"], torch.device("cpu"), "twice")[0]
    assert engine.kernels.chosen == ((1, "twice"),)
    ref = load_engine(tiny_models["target"], torch.device("cpu"), "mkl")[0]
    ids = torch.arange(7) + 100
    got = engine.forward([engine.new_cache()], [ids], [2])[0]
    assert torch.allclose(got, ref.forward([ref.new_cache()], [ids], [2])[0], atol=1e-4)
    calls.clear()
    load_engine(tiny_models["target"], torch.device("cpu"), "auto")
    assert calls, "auto did not time the new kernel"


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
    assert shared_cores_env() == SHARED_CORES_ENV == {"GOMP_SPINCOUNT": "10000"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert shared_cores_env() == {}


def test_local_service_processes_get_that_environment(tiny_models, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    service = ServiceProcess("target", service_args(tiny_models["target"], 1, ["--no-calibrate"]))
    try:
        # Read it once the service serves: between exec's closing of the close-on-exec
        # pipe (when Popen returns) and the new stack's set-up, /proc/PID/environ is empty.
        service.wait_port(timeout_s=120)
        environ = open(f"/proc/{service.proc.pid}/environ", "rb").read().split(b"\0")
        assert b"GOMP_SPINCOUNT=10000" in environ
    finally:
        service.stop()

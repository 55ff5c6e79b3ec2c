"""llama.cpp on the same GGUF file, and the machine's weight-streaming bound: the CPU anchor of
``specdec bench``, one command away.

Systems ``llamacpp`` (greedy decoding) and ``llamacpp-prompt-lookup`` (llama.cpp's prompt
lookup decoding, 10 tokens a block, as ``hf-prompt-lookup``) run the target's GGUF file through
the ``llama-cpp-python`` package on the same cores and threads as the HF baselines. They need
the package (an optional dependency: ``pip install llama-cpp-python==0.3.36`` builds llama.cpp,
several minutes; ``CMAKE_ARGS=-DGGML_NATIVE=ON`` for this machine's best kernels, but on a CPU
with AMX that build of 0.3.36 crashed at its first decode here (a Sapphire Rapids VM): there
``-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON``, as
docs/performance.md gives in full). llama.cpp
multiplies quantized weights with activations quantized to 8 bits, so its greedy text may
depart from transformers' float32 text after a near tie: ``specdec bench`` reports how many of
its tokens agree with HF's instead of counting it as a mismatch.

The bound: a one-token step must read every weight once, so T(1) >= weight bytes / read
bandwidth. ``read_bandwidth_gbs`` measures the bandwidth (a sum over as many bytes as the
weights, the median of a few passes) at a thread count; ``weight_bytes`` is the GGUF file's
tensor data.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time

SYSTEMS = ("llamacpp", "llamacpp-prompt-lookup")
LOOKUP_TOKENS = 10  # block size of llamacpp-prompt-lookup, as hf-prompt-lookup's
INSTALL = "pip install llama-cpp-python==0.3.36"


class LlamaCpp:
    """The target's GGUF file under llama.cpp, greedy, one generation at a time."""

    def __init__(self, target: str, threads: int, eos_ids: set[int],
                 cores: list[int] | None = None, n_ctx: int = 4096):
        from specdec.models.hub import gguf_file

        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise SystemExit(f"error: the llamacpp systems need llama-cpp-python: {INSTALL} "
                             "(builds llama.cpp, several minutes)") from None
        path = gguf_file(target)
        if path is None:
            raise SystemExit(f"error: the llamacpp systems need a GGUF target, not {target!r}")
        self.cores = cores
        self.eos = set(eos_ids)  # the target's, as the HF baselines stop on
        threads = threads or len(cores or []) or os.cpu_count() or 1
        self._args = dict(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)
        self._models: dict[str, object] = {}

    def _model(self, system: str):
        """One llama.cpp context per system, made on first use: prompt lookup's needs the
        logits of every position (llama-cpp-python sets that when given a draft model)."""
        if system not in self._models:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            extra = {}
            if system == "llamacpp-prompt-lookup":
                extra["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
            self._models[system] = Llama(**self._args, **extra)
        return self._models[system]

    def run(self, system: str, prompt_ids: list[int], max_new: int) -> tuple[list[int], float]:
        """(greedy tokens, wall seconds), prefill included, as the HF baselines are timed."""
        if system not in SYSTEMS:
            raise ValueError(f"not a llama.cpp system: {system!r}")
        llm = self._model(system)
        before = os.sched_getaffinity(0) if self.cores else None
        if self.cores:
            os.sched_setaffinity(0, self.cores)
        tokens: list[int] = []
        try:
            start = time.perf_counter()
            for tok in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
                if tok in self.eos:
                    break
                tokens.append(int(tok))
                if len(tokens) >= max_new:
                    break
            wall = time.perf_counter() - start
        finally:
            if before is not None:
                os.sched_setaffinity(0, before)
        return tokens, wall


def forward_timer(target: str, threads: int, ids: list[int], context: int):
    """ms(rows): llama.cpp's forward over ``rows`` new tokens ``ids[context:context + rows]``
    after the ``context`` tokens before them, on the target's GGUF file, logits of every new
    row (a verify's work, as specdec's timer), each probe cut back to the context first:
    ``specdec bench-verify --engines llamacpp``, the column beside specdec's engines. None
    where llama-cpp-python is missing."""
    from specdec.models.hub import gguf_file

    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    path = gguf_file(target)
    if path is None:
        raise SystemExit(f"error: the llamacpp column needs a GGUF target, not {target!r}")
    threads = threads or os.cpu_count() or 1
    max_rows = len(ids) - context
    llm = Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=max(64, max_rows),
                n_threads=threads, n_threads_batch=threads, logits_all=True, seed=0,
                verbose=False)
    llm.eval(ids[:context])

    def timed(rows: int) -> float:
        llm.n_tokens = context  # (eval first cuts the cache back to n_tokens)
        start = time.perf_counter()
        llm.eval(ids[context:context + rows])
        return (time.perf_counter() - start) * 1000.0

    timed.model = llm  # (its scores: what the probes computed)
    return timed


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def read_bandwidth_gbs(threads: int, nbytes: int = 2**30, passes: int = 5) -> float:
    """Read bandwidth in GB/s at ``threads`` threads: a float32 sum over ``nbytes`` bytes, the
    median of ``passes`` passes after one warm-up. Give it the weights' size: a model that
    fits in the last-level cache streams from there, and so does the sum."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(nbytes // 4)
        data.sum()
        times = []
        for _ in range(passes):
            start = time.perf_counter()
            data.sum()
            times.append(time.perf_counter() - start)
        return data.numel() * 4 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)


def weight_bytes(gguf: pathlib.Path) -> int:
    """Bytes of tensor data in a GGUF file: what a one-token step streams (a tied head reads
    the whole embedding; an untied model's input embedding is read one row a token, so this
    overstates its bound by that table)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors)


def streaming_bound(target: str, threads: list[int]) -> dict | None:
    """{threads: (GB/s, bound ms of a one-token step)} for a GGUF target; None for others."""
    from specdec.models.hub import gguf_file

    path = gguf_file(target)
    if path is None:
        return None
    size = weight_bytes(path)
    out = {"weight_mb": size / 1e6}
    for t in threads:
        gbs = read_bandwidth_gbs(t, size)
        out[t] = dict(read_gbs=gbs, bound_ms=size / (gbs * 1e9) * 1000.0)
    return out

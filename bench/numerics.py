"""Float against integer numerics (issue 34), two measurements on the default target:

- ``python -m bench.numerics layers [reps]``: the default target's linear-layer shapes (Q4_1
  codes; the Q8_0 head) on smallm, float (``sd_linear_g4`` / ``sd_linear_g``) and integer
  (``sd_linear_int``), one thread, ms at 1 / 2 / 3 / 5 / 9 rows, the best of ``reps``
  interleaved calls (on shared cores the minimum is the figure noise does not inflate), and
  the extra row's cost over T(1);
- ``python -m bench.numerics text [threads]``: greedy target-only text of the first 8 chat and
  8 grounded prompts (64 tokens), float against integer engines: which outputs differ, from
  which token, and each engine's decode tokens/s (interleaved prompt by prompt).
"""

from __future__ import annotations

import sys
import time

import torch


def layers(reps: int = 150) -> None:
    from specdec.serving.kernels import SMALLM, GroupedCodes, KernelPlan, Linear

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = (1, 2, 3, 5, 9)
    plan = KernelPlan.fixed(SMALLM)
    for n, k, bits in ((3072, 576, 4), (576, 1536, 4), (960, 576, 4), (49152, 576, 8)):
        lo, hi = (-127, 128) if bits == 8 else (0, 16)
        q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
        d = torch.rand(n, k // 32, generator=gen).half().float() / 64
        m = torch.randn(n, k // 32, generator=gen).half().float() / 8 * (bits == 4)
        codes = GroupedCodes(q, d, m)
        w = codes.dequantize()
        lins = {"float": Linear(w, None, plan, codes),
                "integer": Linear(w, None, plan, codes, integer=True)}
        xs = {r: torch.randn(r, k, generator=gen) for r in rows}
        best = {(a, r): float("inf") for a in lins for r in rows}
        for _ in range(reps):
            for r in rows:
                for a, lin in lins.items():
                    t0 = time.perf_counter()
                    lin(xs[r])
                    best[a, r] = min(best[a, r], (time.perf_counter() - t0) * 1e3)
        for a in lins:
            t1 = best[a, 1]
            print(f"{n}x{k} q{bits} {a:8s} " + " ".join(f"{r}:{best[a, r]:.3f}" for r in rows)
                  + "  extra row / T(1): " + " ".join(
                      f"{(best[a, r] - t1) / ((r - 1) * t1):.2f}" for r in rows[1:]))


def text(threads: int = 1, new_tokens: int = 64) -> None:
    from bench.harness import load_prompts
    from specdec.models.hub import default_gguf_path, load_hf_model
    from specdec.models.tokenizer import encode_prompt
    from specdec.serving.engine import LlamaEngine

    torch.set_num_threads(threads)
    model, tok = load_hf_model("default")
    engines = {n: LlamaEngine.from_hf(model, "cpu", "auto", gguf=default_gguf_path(),
                                      numerics=n) for n in ("float", "integer")}

    def greedy(engine, ids):
        cache, out = engine.new_cache(), []
        logits = engine.forward([cache], [torch.tensor(ids)], [1])[0][0]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits = engine.forward([cache], [torch.tensor(out[-1:])], [1])[0][0]
        return out, time.perf_counter() - t0

    busy, first = {n: 0.0 for n in engines}, []
    for name in ("default", "grounded"):
        for i, prompt in enumerate(load_prompts(name)[:8]):
            ids = encode_prompt(tok, prompt, None)
            outs = {}
            for n, engine in engines.items():
                outs[n], s = greedy(engine, ids)
                busy[n] += s
            a, b = outs["float"], outs["integer"]
            at = next((j for j in range(new_tokens) if a[j] != b[j]), None)
            first.append(at)
            print(f"{name} {i}: first differing token {at}")
            if at is not None:
                print(f"  float:   {tok.decode(a)!r}\n  integer: {tok.decode(b)!r}")
    print(f"{sum(f is not None for f in first)}/{len(first)} outputs differ; first differing "
          f"tokens {first}")
    for n, s in busy.items():
        print(f"{n}: {len(first) * new_tokens / s:.1f} tok/s decoding")


if __name__ == "__main__":
    what, *rest = sys.argv[1:] or ["layers"]
    {"layers": layers, "text": text}[what](*map(int, rest))

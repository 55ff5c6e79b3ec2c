"""A long prompt prefills beside decoding sessions in chunks sized by time, so it stalls no one.

Verdicts never depend on measured time: the budget is fed crafted pass times, and the
scheduler test runs the tiny engine under a clock that advances by a crafted cost per pass.
"""

import threading

import pytest
import torch

from specdec.serving.scheduler import BatchScheduler, Piece, PrefillBudget


def _learned(decode_ms: float, prefill_ms_per_token: float, share: float = 0.7,
             token_budget: int = 256) -> PrefillBudget:
    """A budget that saw a decode-only pass and a pass with 100 prefill tokens beside it."""
    budget = PrefillBudget(token_budget, share)
    budget.observe(decode_ms, decoding=True, prefill_tokens=0)
    budget.observe(decode_ms + 100 * prefill_ms_per_token, decoding=True, prefill_tokens=100)
    return budget


def test_a_pass_shared_with_decoding_gets_the_share_of_a_decode_pass():
    # 0.7 * 10 ms = 7 ms of prefill beside a 10 ms decode pass
    assert _learned(10.0, 4.0).tokens(decoding=True) == 1  # 7 / 4
    assert _learned(10.0, 2.0).tokens(decoding=True) == 3  # 7 / 2
    assert _learned(10.0, 0.5).tokens(decoding=True) == 14
    assert _learned(10.0, 2.0, share=0.5).tokens(decoding=True) == 2
    # a session between its rounds waits on the pass as well
    assert _learned(10.0, 2.0).tokens(decoding=False, waited_on=True) == 3


def test_a_pass_nobody_waits_on_gets_the_full_token_budget():
    assert _learned(10.0, 4.0).tokens(decoding=False) == 256
    assert PrefillBudget(64).tokens(decoding=False) == 64  # nothing learned yet


def test_at_most_the_token_budget_and_a_dear_token_every_few_passes():
    assert _learned(10.0, 0.001, token_budget=64).tokens(decoding=True) == 64
    # one token costs 5 decode passes (attention at a long context): 7 ms of prefill a pass
    # carries over until it pays for one, so the prompt gets a token every 7 or 8 passes and
    # the decoding sessions keep their share (a floor of one token a pass would cost them
    # 5 decode passes every pass)
    budget = _learned(10.0, 50.0)
    chunks = []
    for _ in range(40):
        n = budget.tokens(decoding=True)
        chunks.append(n)
        budget.observe(10.0 + 50.0 * n, decoding=True, prefill_tokens=n)
    assert 4 <= sum(chunks) <= 6 and max(chunks) == 1  # 40 passes x 7 ms / 50 ms = 5.6
    # (consecutive token passes are 7-8 passes apart)
    positions = [i for i, n in enumerate(chunks) if n]
    assert all(7 <= b - a <= 8 for a, b in zip(positions, positions[1:])), positions
    # a pass that carries no decoding piece (a session between its rounds waits on it) runs
    # only to prefill, so it takes at least one token
    assert _learned(10.0, 50.0).tokens(decoding=False, waited_on=True) == 1


def test_a_costlier_context_shrinks_the_chunk():
    """Attention: each chunk of a prompt attends to more context, so costs more per token."""
    budget = _learned(10.0, 1.0)
    chunks = [budget.tokens(decoding=True)]
    for ms_per_token in (1.5, 2.0, 3.0, 4.0, 6.0, 8.0):  # the prompt's context grows
        n = chunks[-1]
        budget.observe(10.0 + n * ms_per_token, decoding=True, prefill_tokens=n)
        chunks.append(budget.tokens(decoding=True))
    assert chunks == sorted(chunks, reverse=True) and chunks[0] == 7 and chunks[-1] <= 2


def test_decode_passes_are_measured_first_and_then_again_now_and_then():
    budget = PrefillBudget(256, 0.7, remeasure_every=4)
    assert budget.tokens(decoding=True) == 0  # no decode-only pass seen: this one measures it
    assert budget.tokens(decoding=False, waited_on=True) == 1  # (nothing to measure without one)
    budget.observe(10.0, decoding=True, prefill_tokens=0)
    assert budget.tokens(decoding=True) == 1  # prefill's cost is unknown yet: the floor
    for _ in range(3):
        budget.observe(14.0, decoding=True, prefill_tokens=2)
        assert budget.tokens(decoding=True) == 3
    budget.observe(14.0, decoding=True, prefill_tokens=2)
    assert budget.tokens(decoding=True) == 0  # 4 shared passes since: measure again
    budget.observe(12.0, decoding=True, prefill_tokens=0)
    assert budget.decode_ms == pytest.approx(10.5)  # decayed: 10 + 0.25 * (12 - 10)
    assert budget.tokens(decoding=True) == 3


def test_bad_share_is_refused():
    with pytest.raises(ValueError, match="share"):
        PrefillBudget(share=0.0)


# ---- the scheduler, on the tiny engine, under a crafted clock ---------------------------

DECODE_MS, PREFILL_MS, SHARE, TOKEN_BUDGET = 10.0, 2.0, 0.7, 64
MAX_CHUNK = int(SHARE * DECODE_MS / PREFILL_MS)  # 3: what the costs allow beside a decode


class _CraftedCostEngine:
    """The tiny engine, whose passes take (on ``now``, the scheduler's clock) 10 ms plus 2 ms
    per token of the long prompt; it records each pass's tokens per cache."""

    def __init__(self, engine):
        self.engine = engine
        self.now = 0.0
        self.long_cache = None
        self.passes: list[dict] = []  # per pass: {id(cache): new tokens}

    def new_cache(self):
        return self.engine.new_cache()

    def forward(self, caches, tokens, num_logits):
        self.passes.append({id(c): int(t.shape[0]) for c, t in zip(caches, tokens)})
        long_tokens = sum(int(t.shape[0]) for c, t in zip(caches, tokens) if c is self.long_cache)
        self.now += (DECODE_MS + PREFILL_MS * long_tokens) / 1000.0
        return self.engine.forward(caches, tokens, num_logits)


class _Gate:
    """Holds works back until all of them have started: they are submitted together."""

    def __init__(self, works: int):
        self.left = works
        self.open = threading.Event()

    def arrive(self):
        self.left -= 1  # (start() runs on the model thread only)
        if self.left == 0:
            self.open.set()


class _Session:
    """One call of a session: its prompt in prefill chunks (every row's logits kept), then
    ``steps`` greedy decode steps, one token a pass (the last prompt token is the first)."""

    def __init__(self, session_id, engine, prompt, steps, gate):
        self.session_id, self.cancelled = session_id, False
        self.compute_s, self.batch_size, self.pass_tokens, self.queued_s = 0.0, 0, 0, 0.0
        self.cache = engine.new_cache()
        self.prompt, self.steps, self.gate = prompt, steps, gate
        self.head = len(prompt) - 1 if steps else len(prompt)  # prefilled
        self.fed, self.piece = 0, None
        self.logits: list[torch.Tensor] = []  # the prefill rows'
        self.tokens: list[int] = []

    def start(self):
        self.gate.arrive()

    def next_piece(self, budget):
        if not self.gate.open.is_set():
            return None
        if self.fed < self.head:
            n = min(budget, self.head - self.fed)
            chunk = torch.tensor(self.prompt[self.fed:self.fed + n])
            self.piece = Piece(self.cache, chunk, n, prefill=True)
        else:
            last = self.tokens[-1] if self.tokens else self.prompt[-1]
            self.piece = Piece(self.cache, torch.tensor([last]), 1, prefill=False)
        return self.piece

    def consume(self, logits):
        if self.piece.prefill:
            self.fed += int(self.piece.tokens.shape[0])
            self.logits.append(logits)
        else:
            self.tokens.append(int(logits[-1].argmax()))
        return self.fed == self.head and len(self.tokens) == self.steps

    def result(self):
        return self


def _run_together(engine, works):
    sched = BatchScheduler(engine, max_batch=8, token_budget=TOKEN_BUDGET,
                           prefill_share=SHARE, clock=lambda: engine.now)
    try:
        futures = [sched.submit(w) for w in works]
        return [f.result(timeout=120) for f in futures]
    finally:
        sched.stop()


@pytest.fixture(scope="module")
def tiny_engine(tiny_models):
    from specdec.models.loading import load_engine

    return load_engine(tiny_models["target"], torch.device("cpu"))[0]


def test_a_long_prompt_beside_a_decoding_session_takes_small_chunks(tiny_engine):
    long_prompt = [100 + (i * 37) % 3000 for i in range(300)]
    small_prompt = [1, 520, 3300, 12]
    engine = _CraftedCostEngine(tiny_engine)
    gate = _Gate(2)
    long = _Session("long", engine, long_prompt, steps=0, gate=gate)
    small = _Session("small", engine, small_prompt, steps=40, gate=gate)
    engine.long_cache = long.cache
    _run_together(engine, [long, small])

    def long_tokens(p):
        return p.get(id(long.cache), 0)

    with_small = [p for p in engine.passes if id(small.cache) in p]
    # the pass that prefilled the small prompt, then one per decode step
    assert len(with_small) == 1 + small.steps
    # the small prompt went first (shortest) and finished: the long one got a shared chunk
    assert with_small[0][id(small.cache)] == len(small_prompt) - 1
    # every pass the small session waited on carried at most what the costs allow
    assert max(long_tokens(p) for p in with_small) <= MAX_CHUNK
    assert sum(long_tokens(p) == MAX_CHUNK for p in with_small) > small.steps // 2
    assert long_tokens(with_small[1]) == 0  # the first decode pass measured a decode pass
    # once nobody waits, the long prompt takes full chunks
    last = max(i for i, p in enumerate(engine.passes) if id(small.cache) in p)
    after = engine.passes[last + 1:]
    assert after and all(long_tokens(p) == TOKEN_BUDGET for p in after[:-1])

    # chunking changed no result: the long prompt's logits are those of one whole prefill,
    # the small session's tokens those of decoding it alone
    cache = tiny_engine.new_cache()
    alone = tiny_engine.forward([cache], [torch.tensor(long_prompt)], [len(long_prompt)])[0]
    torch.testing.assert_close(torch.cat(long.logits), alone, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.cat(long.logits).argmax(-1), alone.argmax(-1))
    solo = _Session("solo", engine, small_prompt, steps=40, gate=_Gate(1))
    _run_together(engine, [solo])
    assert solo.tokens == small.tokens

"""The acceptance rule: crafted logits that make every decision certain, then statistics."""

import pytest
import torch

from specdec.config import SamplingParams
from specdec.serving.acceptance import verify_rejection, verify_walk
from specdec.serving.sampling import position_generator
from specdec.serving.target import emitted_logprobs, greedy_rows

BIG = 50.0


def onehot_logits(tokens, vocab=8):
    """[len(tokens), vocab] logits whose argmax is each token by a large margin."""
    logits = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        logits[i, t] = BIG
    return logits


def verify_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """The target service's greedy verdict: the walk along its rows' argmax."""
    return verify_walk(drafts.tolist(), greedy_rows(logits, logits, None)[0])


def gens(n, seed=0):
    return [position_generator(seed, i, "target") for i in range(n)]


# -- greedy ---------------------------------------------------------------------------------

def test_greedy_perfect_match_gives_bonus():
    n, nxt = verify_greedy(torch.tensor([3, 1, 4]), onehot_logits([3, 1, 4, 5]))
    assert (n, nxt) == (3, 5)


def test_greedy_first_token_miss():
    n, nxt = verify_greedy(torch.tensor([2, 1, 4]), onehot_logits([3, 1, 4, 5]))
    assert (n, nxt) == (0, 3)


def test_greedy_miss_in_the_middle():
    n, nxt = verify_greedy(torch.tensor([3, 1, 7, 5]), onehot_logits([3, 1, 4, 5, 6]))
    assert (n, nxt) == (2, 4)


def test_greedy_empty_block_is_a_plain_step():
    n, nxt = verify_greedy(torch.tensor([], dtype=torch.long), onehot_logits([6]))
    assert (n, nxt) == (0, 6)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values into Python (device-to-host copies)."""

    READS = {"tolist", "item", "__int__", "__float__", "numpy", "cpu", "__bool__"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("top", [None, 0, 3])
def test_a_greedy_verdicts_tokens_and_logprobs_come_in_one_read(top):
    """The rows' argmax of the processed logits, and the model's own logprobs of them with
    their top alternatives, exactly as ``emitted_logprobs`` gives them, in one host read
    (mutant: the verdict then ``emitted_logprobs`` reads 2-3 times)."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(5, 300, generator=gen) * 4
    processed = raw.clone()
    processed[2, 7] += 100.0  # a bias moves row 2's choice away from the model's argmax
    with HostReads() as reads:
        tokens, rows = greedy_rows(processed, raw, top)
    assert len(reads.reads) == 1, reads.reads
    assert tokens == processed.argmax(-1).tolist() and tokens[2] == 7
    if top is None:
        assert rows is None
    else:
        assert rows == emitted_logprobs(raw, tokens, top)
        with HostReads() as reads:  # the verdict's read, then the logprobs' own
            emitted_logprobs(raw, processed.argmax(-1).tolist(), top)
        assert len(reads.reads) >= 2


# -- sampling, certain decisions ------------------------------------------------------------

def probs_onehot(tokens, vocab=8):
    p = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        p[i, t] = 1.0
    return p


def test_sampling_all_accepted_plus_bonus():
    draft = torch.tensor([3, 1])
    n, nxt = verify_rejection(draft, probs_onehot([3, 1]), probs_onehot([3, 1, 6]), gens(3))
    assert (n, nxt) == (2, 6)


def test_sampling_first_token_rejected_takes_residual():
    # The target gives the draft's token zero mass: certain rejection; residual is all on 5.
    draft = torch.tensor([3, 1])
    n, nxt = verify_rejection(draft, probs_onehot([3, 1]), probs_onehot([5, 1, 6]), gens(3))
    assert (n, nxt) == (0, 5)


def test_sampling_empty_block_samples_from_target():
    n, nxt = verify_rejection(torch.tensor([], dtype=torch.long), torch.zeros(0, 8),
                             probs_onehot([4]), gens(1))
    assert (n, nxt) == (0, 4)


def test_sampling_zero_draft_probability_is_rejected_not_divided():
    # A broken draft claims q(x) = 0 for its own token: reject, never divide by zero.
    target = torch.full((2, 8), 1 / 8)
    n, nxt = verify_rejection(torch.tensor([2]), torch.zeros(1, 8), target, gens(2))
    assert n == 0 and 0 <= nxt < 8


def test_sampling_is_seeded():
    torch.manual_seed(0)
    target = torch.rand(4, 8).softmax(-1)
    draft_probs = torch.rand(3, 8).softmax(-1)
    draft = torch.tensor([1, 2, 3])
    a = verify_rejection(draft, draft_probs, target, gens(4, seed=7))
    b = verify_rejection(draft, draft_probs, target, gens(4, seed=7))
    assert a == b


# -- sampling, statistics --------------------------------------------------------------------

def emitted_first_token_distribution(target_p, draft_q, n_samples, seed):
    """Empirical distribution of the first emitted token of a k=1 round."""
    vocab = target_p.shape[-1]
    counts = torch.zeros(vocab)
    g = torch.Generator().manual_seed(seed)
    for s in range(n_samples):
        x = int(torch.multinomial(draft_q, 1, generator=g))
        target = torch.stack([target_p, target_p])  # [k + 1, vocab]
        n, nxt = verify_rejection(torch.tensor([x]), draft_q[None], target,
                                 [position_generator(seed, 2 * s + i, "target") for i in range(2)])
        counts[x if n == 1 else nxt] += 1
    return counts / n_samples


CASES = {
    "different": (torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0]), torch.tensor([0.1, 0.1, 0.3, 0.2, 0.3])),
    "draft_equals_target": (torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0]),
                            torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])),
    # the draft puts mass (0.6) on token 4, where the target has none
    "draft_mass_where_target_has_none": (torch.tensor([0.3, 0.3, 0.4, 0.0, 0.0]),
                                         torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6])),
    # a deterministic proposal (prompt lookup, n-grams): q is one-hot on the proposed token
    "deterministic_proposal": (torch.tensor([0.3, 0.3, 0.4, 0.0, 0.0]),
                               torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampling_preserves_the_target_distribution(case):
    target_p, draft_q = CASES[case]
    tv = {}
    for n in (500, 8000):
        emp = emitted_first_token_distribution(target_p, draft_q, n, seed=11)
        tv[n] = 0.5 * float((emp - target_p).abs().sum())
        # the bound shrinks with samples like 1/sqrt(n) (about 3.5 standard deviations)
        assert tv[n] < 1.75 * (len(target_p) / n) ** 0.5, (case, n, tv[n])
    assert float(emp[target_p == 0].sum()) == 0.0  # never emits what the target cannot


# -- per-position random streams --------------------------------------------------------------

def test_position_streams_do_not_collide_where_32_bit_seeds_did():
    # torch's CPU generator keeps 32 bits of its seed: positions 15564 and 79230 of seed 7
    # (found by a birthday search over the earlier blake2b-derived seeds) drew one stream.
    a, b = position_generator(7, 15564, "target"), position_generator(7, 79230, "target")
    assert [a.uniform() for _ in range(4)] != [b.uniform() for _ in range(4)]


def test_position_streams_depend_on_seed_position_and_domain_only():
    def draws(*key):
        g = position_generator(*key)
        return [g.uniform() for _ in range(3)]

    assert draws(3, 10, "target") == draws(3, 10, "target")
    assert len({tuple(draws(*key)) for key in [(3, 10, "target"), (3, 11, "target"),
                                               (4, 10, "target"), (3, 10, "draft"),
                                               (3 + 2**32, 10, "target")]}) == 5


def test_categorical_draws_follow_the_probabilities_and_never_pick_zero_mass():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2, 0.0])
    n = 20_000
    counts = torch.zeros(5)
    for pos in range(n):
        counts[position_generator(11, pos, "draft").categorical(probs)] += 1
    assert counts[2] == 0 and counts[4] == 0
    assert (counts / n - probs).abs().max() < 0.015  # ~4 standard deviations at n = 20,000


def test_acceptance_rule_travels_on_the_wire_and_unspecified_is_the_default():
    from specdec.config import DEFAULT_RULE, RULES
    from specdec.wire import specdec_pb2 as pb

    for rule in RULES:
        params = SamplingParams(temperature=0.5, seed=3, rule=rule)
        assert SamplingParams.from_wire(params.to_wire(pb)).rule == rule
    assert SamplingParams.from_wire(pb.SamplingParams(temperature=1.0)).rule == DEFAULT_RULE
    assert DEFAULT_RULE == "coupled"
    with pytest.raises(ValueError, match="rule"):
        SamplingParams.from_wire(pb.SamplingParams(temperature=1.0, rule=7))
    with pytest.raises(ValueError, match="rule must be one of"):
        SamplingParams(temperature=1.0, rule="typical")
    assert SamplingParams(temperature=1.0).drafter_invariant
    assert SamplingParams(rule="rejection").drafter_invariant  # greedy: any rule
    assert not SamplingParams(temperature=1.0, rule="rejection").drafter_invariant


def test_coupling_noise_is_per_id_and_exponential():
    """E[t] depends on (seed, position, t) only: any subset of ids sees the same values, so a
    draft over its few likeliest tokens and a target over its whole support agree."""
    import numpy as np

    from specdec.serving.sampling import coupling_noise

    ids = np.arange(5000)
    full = coupling_noise(9, 40, ids)
    subset = np.array([4999, 7, 123, 7])
    assert np.array_equal(coupling_noise(9, 40, subset), full[subset])
    assert not np.allclose(coupling_noise(9, 41, ids), full)
    assert not np.allclose(coupling_noise(10, 40, ids), full)
    # Exponential(1): mean 1, variance 1, P(E > 1) = 1/e
    assert abs(full.mean() - 1) < 0.05 and abs(full.var() - 1) < 0.1
    assert abs((full > 1).mean() - np.exp(-1)) < 0.03


def _python_noise(seed: int, position: int, token_id: int) -> float:
    """The coupling noise of one id in plain Python integers: the reference the array versions
    (numpy's uint32, torch's int64 on any device) must equal bit for bit."""
    import math

    import numpy as np

    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    k1, k2 = (int(x) for x in np.random.SeedSequence([seed, position, 3]).generate_state(
        2, np.uint32))
    h = fmix(((token_id * 0x9E3779B9) & 0xFFFFFFFF) ^ k1)
    h = fmix(h ^ k2)
    return -math.log((h + 0.5) * (1.0 / 2**32))


def test_the_device_noise_and_race_equal_the_cpu_reference():
    """The coupled rule on a device: ``device_noise`` (torch's integer ops, exact on a GPU as
    on the CPU) equals numpy's ``coupling_noise`` and plain Python's hash bit for bit, and
    ``coupled_choices`` (every row of a verify block raced where the probabilities are,
    fetched in one copy) picks what ``coupled_choice`` picks row by row, reduced draft
    vocabularies included; the walk over those rows is ``verify_coupled``'s. (Mutants: a
    multiplication that overflows int64 or drops the high half, or races over the wrong row's
    position, fail it.)"""
    import numpy as np

    from specdec.config import SamplingParams
    from specdec.serving.acceptance import verify_coupled, verify_walk
    from specdec.serving.sampling import (
        coupled_choice,
        coupled_choices,
        coupling_noise,
        device_noise,
        process_logits,
    )

    ids = np.array([0, 1, 2**16 + 3, 49151, 151935, 2**31 - 1])
    for seed, position in ((0, 0), (9, 40), (2**31 - 1, 2**20)):
        want = np.array([_python_noise(seed, position, int(t)) for t in ids])
        assert np.array_equal(coupling_noise(seed, position, ids), want)
        got = device_noise(seed, range(position, position + 2), torch.from_numpy(ids))
        assert np.array_equal(got[0].numpy(), want)
        assert np.array_equal(got[1].numpy(), coupling_noise(seed, position + 1, ids))
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        params = SamplingParams(temperature=0.9, top_k=50 if trial % 2 else 0, seed=trial)
        probs = process_logits(torch.randn(5, 3000, generator=g) * 3, params)  # [5, vocab]
        rows = [coupled_choice(probs[i], trial, 70 + i) for i in range(5)]
        assert coupled_choices(probs, trial, 70) == rows
        target_ids = np.random.default_rng(trial).permutation(50000)[:3000]
        assert coupled_choices(probs[:1], trial, 9, target_ids) == \
            [coupled_choice(probs[0], trial, 9, target_ids)]
        drafts = torch.tensor(rows[:2] + [rows[2] + 1, rows[3]])
        assert verify_walk(drafts.tolist(), coupled_choices(probs, trial, 70)) == \
            verify_coupled(drafts, probs, trial, 70) == (2, rows[2])


@pytest.mark.parametrize("top", [None, 2])
def test_a_coupled_verdict_on_the_device_is_one_read(top):
    """The race's winners of every row and their logprobs come in one host read, the same
    tokens as numpy's race (``verify_coupled``) and logprobs as ``emitted_logprobs``."""
    from specdec.serving.acceptance import verify_coupled
    from specdec.serving.sampling import coupled_race, process_logits
    from specdec.serving.target import emitted_rows

    gen = torch.Generator().manual_seed(4)
    raw = torch.randn(4, 200, generator=gen) * 3
    sampling = SamplingParams(temperature=0.9, seed=12)
    probs = process_logits(raw, sampling)
    want = [verify_coupled(torch.tensor([], dtype=torch.long), probs[i:i + 1], 12, 30 + i)[1]
            for i in range(4)]  # each row's own coupled sample (numpy's race)
    with HostReads() as reads:
        choice, race = coupled_race(probs, 12, 30)
        tokens, rows = emitted_rows(choice, raw, top, valid=race > 0)
    assert len(reads.reads) == 1, reads.reads
    assert tokens == want
    assert verify_walk(want[:2] + [(want[2] + 1) % 200], tokens) == (2, want[2])
    if top is not None:
        ref = emitted_logprobs(raw, tokens, top)
        assert [r[0] for r in rows] == pytest.approx([r[0] for r in ref], abs=1e-6)
        assert [r[1] for r in rows] == [r[1] for r in ref]


def test_the_device_verdict_path_serves_the_same_tokens_and_logprobs(tiny_services,
                                                                     monkeypatch):
    """A coupled verify with logprobs through the tiny target's service: the device path (one
    read, ``DEVICE_VERDICT_ON_CPU``) answers exactly what numpy's race and a second read do,
    for a block the target accepts in part."""
    import grpc

    from specdec.serving import target as target_mod
    from specdec.wire import specdec_pb2 as pb
    from specdec.wire import specdec_pb2_grpc as pb_grpc

    sampling = SamplingParams(temperature=0.9, seed=5).to_wire(pb)
    prompt = [1, 520, 3300, 12, 99, 7]
    with grpc.insecure_channel(tiny_services["target"].address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)

        def verify(sid, drafts):
            return stub.Verify(pb.VerifyRequest(
                session=pb.SessionRef(session_id=sid), tokens=prompt, draft_tokens=drafts,
                sampling=sampling, logprobs=True, top_logprobs=3), timeout=30)

        first = verify("own", []).next_token  # the target's own sample at the first position
        answers = {}
        for on_device in (False, True):
            monkeypatch.setattr(target_mod, "DEVICE_VERDICT_ON_CPU", on_device)
            answers[on_device] = verify(f"dev-{on_device}", [first, 17, 17])
        for sid in ("own", "dev-False", "dev-True"):  # (the services are shared: leave none)
            stub.CloseSession(pb.CloseRequest(session_id=sid), timeout=30)
    off, on = answers[False], answers[True]
    assert off.num_accepted >= 1 and (on.num_accepted, on.next_token) == \
        (off.num_accepted, off.next_token)
    assert [(e.logprob, list(e.top_ids)) for e in on.logprobs] == \
        [(e.logprob, list(e.top_ids)) for e in off.logprobs]

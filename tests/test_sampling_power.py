"""Sampling rules tested with power (after vLLM's rejection-sampler tests).

Every test compares the emitted tokens at *every* position of a k = 3 block (accepted,
recovered and bonus tokens alike) with the target's exact distribution: per-position marginals
and the joints of neighbouring positions, by a chi-square test with a fixed threshold. Each
test is parametrized over wrong rules as well as the real one: the real rule must pass and
every wrong rule must fail, so the tests show they can tell.

Two levels:
- the rules alone (specdec.serving.acceptance) over crafted distributions, with the draft's side as
  the service runs it (position streams, q sent sparse);
- whole generations through real gRPC services (spec and pipelined rounds) with a draft of
  reduced vocabulary whose q is truncated to its top tokens, against a tiny target whose exact
  distribution over the first four tokens is enumerated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ServiceThread, make_tiny_model, run

import specdec.serving.acceptance as acceptance
from specdec.config import SamplingParams
from specdec.serving.sampling import (
    coupled_choice,
    from_sparse,
    position_generator,
    process_logits,
    sample,
    to_sparse,
)

P_VALUE = 1e-6  # the real rules pass with every fixed seed set below; wrong rules fall far under


def chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson chi-square p-value of counts against probabilities (cells expected < 5 pooled;
    a count where the probability is 0 gives p = 0)."""
    n = counts.sum()
    if np.any(counts[expected_p <= 0] > 0):
        return 0.0
    exp = expected_p * n
    big = exp >= 5
    obs_cells = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    exp_cells = list(exp[big]) + ([exp[~big].sum()] if (~big).any() else [])
    obs_cells, exp_cells = np.array(obs_cells, float), np.array(exp_cells, float)
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    df = max(int(keep.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def worst_pvalue(samples: list[list[int]], marginals: list[np.ndarray],
                 pairs: dict[tuple[int, int], np.ndarray]) -> tuple[float, str]:
    """The smallest p-value over positions' marginals and neighbour pairs' joints (each among
    the samples that reached it), and which test gave it."""
    vocab = len(marginals[0])
    worst = (1.0, "")
    for j, p in enumerate(marginals):
        counts = np.bincount([s[j] for s in samples if len(s) > j], minlength=vocab)
        worst = min(worst, (chi2_pvalue(counts, p), f"position {j}"))
    for (a, b), joint in pairs.items():
        cells = [s[a] * vocab + s[b] for s in samples if len(s) > b]
        counts = np.bincount(cells, minlength=vocab * vocab)
        worst = min(worst, (chi2_pvalue(counts, joint.flatten()), f"positions {a},{b}"))
    return worst


# ---- the rules alone ---------------------------------------------------------------------

K = 3
# Target rows for positions 0..3 (the target here does not depend on the prefix, so the exact
# distribution of the emitted tokens is the product of these rows), draft rows for 0..2: they
# disagree by TV 0.3-0.5, each has tokens the other lacks.
P_ROWS = torch.tensor([
    [0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
    [0.05, 0.45, 0.30, 0.00, 0.10, 0.10],
    [0.30, 0.00, 0.30, 0.20, 0.10, 0.10],
    [0.10, 0.20, 0.10, 0.50, 0.00, 0.10],
], dtype=torch.float64)
Q_ROWS = torch.tensor([
    [0.10, 0.45, 0.15, 0.00, 0.10, 0.20],
    [0.30, 0.25, 0.25, 0.20, 0.00, 0.00],
    [0.55, 0.10, 0.15, 0.10, 0.10, 0.00],
], dtype=torch.float64)
FIRST = 17  # position of the block's first token
ROUNDS = 3000


def _rejection_mutants():
    """Wrong rejection rules, each with verify_rejection's signature."""
    def accept_always(drafts, q, p, gens):
        return len(drafts), gens[len(drafts)].categorical(p[len(drafts)])

    def accept_with_p_resample_p(drafts, q, p, gens):
        for i, x in enumerate(drafts.tolist()):
            if gens[i].uniform() >= float(p[i, x]):
                return i, gens[i].categorical(p[i])
        return len(drafts), gens[len(drafts)].categorical(p[len(drafts)])

    def residual_p(drafts, q, p, gens):
        for i, x in enumerate(drafts.tolist()):
            if not gens[i].uniform() * float(q[i, x]) < float(p[i, x]):
                return i, gens[i].categorical(p[i])
        return len(drafts), gens[len(drafts)].categorical(p[len(drafts)])

    def bonus_from_q(drafts, q, p, gens):
        n, token = acceptance.verify_rejection(drafts, q, p, gens)
        if n == len(drafts) and n:  # the bonus drawn from the draft's (last) distribution
            token = gens[n].categorical(q[-1])
        return n, token

    return dict(accept_always=accept_always, accept_with_p_resample_p=accept_with_p_resample_p,
                residual_p=residual_p, bonus_from_q=bonus_from_q)


def _coupled_mutants():
    """Wrong coupled rules, each with verify_coupled's signature."""
    def accept_always(drafts, p, seed, first):
        return len(drafts), coupled_choice(p[len(drafts)], seed, first + len(drafts))

    def bonus_with_the_last_tokens_noise(drafts, p, seed, first):
        n, token = acceptance.verify_coupled(drafts, p, seed, first)
        if n == len(drafts) and n:
            token = coupled_choice(p[n], seed, first + n - 1)
        return n, token

    def noise_of_the_first_position(drafts, p, seed, first):  # noise not tied to position
        for i, x in enumerate(drafts.tolist() + [None]):
            token = coupled_choice(p[i], seed, first)
            if x != token:
                return i, token
        raise AssertionError

    return dict(accept_always=accept_always,
                bonus_with_the_last_tokens_noise=bonus_with_the_last_tokens_noise,
                noise_of_the_first_position=noise_of_the_first_position)


def _rule_level_generation(rule: str, verify, seed: int) -> list[int]:
    """Positions 0..K as the services produce them: the draft proposes the block up to position
    K - 1 from its position streams (q sent sparse and rebuilt, as on the wire), the rule emits
    n_accepted + 1 tokens, and the next round goes on from there (the first round is a k = K
    block with its bonus at position K)."""
    vocab = P_ROWS.shape[1]
    text: list[int] = []
    while len(text) <= K:
        pos = len(text)
        drafts, q_wire = [], []
        for j in range(pos, K):
            ids, probs = to_sparse(Q_ROWS[j].float())
            q_j = from_sparse(ids, probs, vocab)
            q_wire.append(q_j)
            if rule == "coupled":
                drafts.append(coupled_choice(q_j, seed, FIRST + j))
            else:
                drafts.append(sample(q_j, position_generator(seed, FIRST + j, "draft")))
        drafts_t = torch.tensor(drafts, dtype=torch.long)
        p = P_ROWS[pos:].float()
        if rule == "coupled":
            n, token = verify(drafts_t, p, seed, FIRST + pos)
        else:
            q = torch.stack(q_wire) if q_wire else torch.zeros(0, vocab)
            gens = [position_generator(seed, FIRST + i, "target") for i in range(pos, K + 1)]
            n, token = verify(drafts_t, q, p, gens)
        text += drafts[:n] + [token]
    return text[: K + 1]


def _product_pairs(rows) -> dict:
    return {(a, a + 1): np.outer(rows[a], rows[a + 1]) for a in range(len(rows) - 1)}


RULE_CASES = ([("rejection", None)] + [("rejection", m) for m in _rejection_mutants()]
              + [("coupled", None)] + [("coupled", m) for m in _coupled_mutants()])


@pytest.mark.parametrize("rule,mutant", RULE_CASES,
                         ids=[f"{r}-{m or 'real'}" for r, m in RULE_CASES])
def test_rule_emits_the_target_distribution_at_every_position(rule, mutant):
    real = acceptance.verify_coupled if rule == "coupled" else acceptance.verify_rejection
    verify = real if mutant is None else (
        _coupled_mutants() if rule == "coupled" else _rejection_mutants())[mutant]
    samples = [_rule_level_generation(rule, verify, seed) for seed in range(ROUNDS)]
    rows = P_ROWS.numpy()
    worst, where = worst_pvalue(samples, list(rows), _product_pairs(rows))
    if mutant is None:
        assert worst > P_VALUE, (where, worst)
    else:
        assert worst < P_VALUE, f"the wrong rule {mutant} passed (worst p {worst} at {where})"


def test_rule_level_generations_measure_bonus_and_recovered_tokens():
    """The generations above reach every branch often: first-round bonuses at position K and
    recoveries at every position."""
    bonus = recovered = 0
    for seed in range(2000):
        drafts = [sample(Q_ROWS[j].float(), position_generator(seed, FIRST + j, "draft"))
                  for j in range(K)]
        gens = [position_generator(seed, FIRST + i, "target") for i in range(K + 1)]
        n, _ = acceptance.verify_rejection(torch.tensor(drafts), Q_ROWS.float(),
                                           P_ROWS.float(), gens)
        bonus += n == K
        recovered += n < K
    assert bonus > 2000 // 10 and recovered > 2000 // 2, (bonus, recovered)


def test_coupled_text_does_not_depend_on_the_draft():
    """Under the coupled rule the emitted tokens are the target's own race winners whatever the
    draft proposes: any proposal, from any draft, gives the same text."""
    p = P_ROWS.float()
    for seed in range(200):
        own = [coupled_choice(p[j], seed, FIRST + j) for j in range(K + 1)]
        for drafts in ([], own[:K], [0, 0, 0], own[:1] + [5, 5]):
            text, pos = [], 0
            while pos <= K:  # rounds until position K is emitted
                block = [int(t) for t in drafts[pos:K]] if pos < len(drafts) else []
                n, token = acceptance.verify_coupled(
                    torch.tensor(block, dtype=torch.long), p[pos:pos + len(block) + 1],
                    seed, FIRST + pos)
                text += block[:n] + [token]
                pos += n + 1
            assert text[:K + 1] == own, (seed, drafts)


def test_coupled_acceptance_is_at_least_its_floor():
    """P(draft's race winner == target's) >= (1 - TV) / (1 + TV) (Daliri et al. 2024)."""
    for j in range(K):
        p, q = P_ROWS[j].float(), Q_ROWS[j].float()
        tv = 0.5 * float((p - q).abs().sum())
        same = np.mean([coupled_choice(p, s, 3) == coupled_choice(q, s, 3) for s in range(6000)])
        sd = (0.25 / 6000) ** 0.5
        assert same > (1 - tv) / (1 + tv) - 4 * sd, (j, same, tv)
        assert same < 1 - tv + 4 * sd, (j, same, tv)  # and no rule beats 1 - TV


# ---- whole generations through the services ---------------------------------------------

VOCAB = 16
PROMPT = [1, 5, 9, 3, 12, 7]
GEN_TOKENS = 4  # positions 0..3: one k = 3 block and its bonus (spec); two rounds (pipelined)
GENERATIONS = 1500
REDUCED = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13]  # the draft's vocabulary: 12 of the 16 ids
Q_TOP_K = 6  # the draft samples from (and sends) its 6 likeliest tokens
SERVICE_SAMPLING = dict(temperature=1.0)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A 16-token tiny target, and a draft directory made from a noisy copy of it with a
    reduced vocabulary (its head covers 12 of the 16 ids) served with q truncated to 6 tokens."""
    from specdec.models import draft_model
    from specdec.models.hub import load_hf_model
    from specdec.serving.arch import ArchConfig, canonical_weights

    root = tmp_path_factory.mktemp("smallvocab")
    target = make_tiny_model(root / "target", seed=5, layers=1, hidden=32, heads=2, kv_heads=1,
                             vocab=VOCAB)
    near = make_tiny_model(root / "near", seed=5, layers=1, hidden=32, heads=2, kv_heads=1,
                           vocab=VOCAB, noise=0.6)
    model, _ = load_hf_model(str(near))
    arch = ArchConfig.from_hf(model.config)
    weights = canonical_weights(model.state_dict(), arch)
    vocab_map = torch.tensor(REDUCED)
    weights["head"] = weights["head"][vocab_map]
    draft_dir = root / "draft"
    draft_model.save(draft_dir, arch, weights, vocab_map, str(target), card={}, int8=False)
    services = {
        "target": ServiceThread("target", str(target)),
        "draft": ServiceThread("draft", str(draft_dir), target=str(target), q_top_k=Q_TOP_K),
    }
    yield {"target_dir": str(target), **services}
    for s in services.values():
        s.stop()


def _exact_distribution(model_dir: str, params: SamplingParams):
    """The target's exact joint of its first GEN_TOKENS sampled tokens: [V] * GEN_TOKENS."""
    from specdec.models.hub import load_hf_model

    model, _ = load_hf_model(model_dir)
    joint = np.ones([1])
    prefixes = [[]]
    with torch.no_grad():
        for depth in range(GEN_TOKENS):
            batch = torch.tensor([PROMPT + list(p) for p in prefixes])
            probs = process_logits(model(batch).logits[:, -1], params).double().numpy()
            joint = (joint.reshape(-1, 1) * probs).reshape(-1)
            prefixes = [list(p) + [t] for p in prefixes for t in range(VOCAB)]
    return joint.reshape([VOCAB] * GEN_TOKENS)


def _marginals_and_pairs(joint: np.ndarray):
    n = joint.ndim
    marginals = [joint.sum(axis=tuple(a for a in range(n) if a != j)) for j in range(n)]
    pairs = {(a, a + 1): joint.sum(axis=tuple(x for x in range(n) if x not in (a, a + 1)))
             for a in range(n - 1)}
    return marginals, pairs


async def _generate_many(pair, mode: str, rule: str) -> list[list[int]]:
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    orch = await connect(pair["target"].address, pair["draft"].address,
                         tokenizer_spec=pair["target_dir"])
    orch.eos_ids = set()  # a random model's EOS id would end generations early
    try:
        out = []
        for seed in range(GENERATIONS):
            params = SamplingParams(seed=seed, rule=rule, **SERVICE_SAMPLING)
            req = GenerationRequest(PROMPT, GEN_TOKENS, params, [], mode, K, prompt_lookup=False)
            out.append((await orch.generate(req)))
        return out
    finally:
        await close(orch)


SERVICE_CASES = [
    ("spec", "rejection", None), ("pipelined", "rejection", None),
    ("spec", "coupled", None), ("pipelined", "coupled", None),
    ("pipelined", "rejection", "accept_with_p_resample_p"),
    ("pipelined", "rejection", "residual_p"),
    ("spec", "rejection", "bonus_from_q"),
    ("pipelined", "coupled", "accept_always"),
    ("spec", "coupled", "bonus_with_the_last_tokens_noise"),
]


@pytest.mark.parametrize("mode,rule,mutant", SERVICE_CASES,
                         ids=[f"{m}-{r}-{x or 'real'}" for m, r, x in SERVICE_CASES])
def test_generations_have_the_target_distribution(small_vocab_pair, monkeypatch, mode, rule,
                                                  mutant):
    import specdec.serving.target

    if mutant is not None:  # the target service runs in this process: swap its rule
        mutants = _coupled_mutants() if rule == "coupled" else _rejection_mutants()
        name = "verify_coupled" if rule == "coupled" else "verify_rejection"
        monkeypatch.setattr(specdec.serving.target, name, mutants[mutant])
    joint = _exact_distribution(small_vocab_pair["target_dir"], SamplingParams(
        **SERVICE_SAMPLING))
    results = run(_generate_many(small_vocab_pair, mode, rule))
    samples = [r.token_ids for r in results]
    assert all(len(s) == GEN_TOKENS for s in samples)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    if mutant is None:  # the draft's tokens were verified, some kept and some not
        assert 0.2 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
        if mode == "pipelined":
            assert sum(r.stats.pipeline_hits for r in results) > GENERATIONS // 20
    worst, where = worst_pvalue(samples, *_marginals_and_pairs(joint))
    if mutant is None:
        assert worst > P_VALUE, (where, worst)
    else:
        assert worst < P_VALUE, f"the wrong rule {mutant} passed (worst p {worst} at {where})"


def test_coupled_generations_are_the_same_in_every_mode_and_k(small_vocab_pair):
    """A seeded coupled request gives the same tokens target-only, spec and pipelined, at any
    k, and with no draft at all."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect

    async def texts():
        with_draft = await connect(small_vocab_pair["target"].address,
                                   small_vocab_pair["draft"].address,
                                   tokenizer_spec=small_vocab_pair["target_dir"])
        alone = await connect(small_vocab_pair["target"].address, None,
                              tokenizer_spec=small_vocab_pair["target_dir"])
        for o in (with_draft, alone):
            o.eos_ids = set()
        try:
            out = {}
            for seed in range(30):
                params = SamplingParams(temperature=1.0, seed=seed)
                for name, orch, mode, k in [("alone", alone, "target-only", None),
                                            ("target-only", with_draft, "target-only", None),
                                            ("spec-1", with_draft, "spec", 1),
                                            ("spec-5", with_draft, "spec", 5),
                                            ("spec-adaptive", with_draft, "spec", None),
                                            ("pipelined-3", with_draft, "pipelined", 3),
                                            ("pipelined-8", with_draft, "pipelined", 8)]:
                    r = await orch.generate(GenerationRequest(PROMPT, 24, params, [], mode, k))
                    out.setdefault(seed, {})[name] = r.token_ids
            return out
        finally:
            await close(with_draft)
            await close(alone)

    out = run(texts())
    for seed, by_mode in out.items():
        assert len(set(map(tuple, by_mode.values()))) == 1, (seed, by_mode)
    assert len({tuple(v["alone"]) for v in out.values()}) > 25  # seeds do change the text

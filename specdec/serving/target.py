"""The target's side of a round: score a draft block in one pass and apply the acceptance rule."""

from __future__ import annotations

import dataclasses

import torch

from specdec.config import MAX_DECODE_ON, MAX_K, MAX_TOP_LOGPROBS, SamplingParams
from specdec.serving.acceptance import verify_coupled, verify_rejection, verify_walk
from specdec.serving.engine import LlamaEngine
from specdec.serving.feature_engine import half_features
from specdec.serving.grammar import Grammars, block_masks, mask_logits
from specdec.serving.sampling import (
    bias_logits,
    coupled_race,
    from_sparse,
    penalize,
    position_generator,
    process_logits,
)
from specdec.serving.scheduler import Piece, Work
from specdec.serving.session import SessionStore


MAX_FEATURE_LAYERS = 8  # layers a verify may ask features of (VerifyRequest.feature_layers)


@dataclasses.dataclass
class VerifyCall:
    """A validated verify request."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    tokens: list[int]  # committed tokens to append; the last one precedes the block
    draft_tokens: list[int]  # [k]
    draft_dists: list[tuple[list[int], list[float]]]  # k sparse q's (rejection rule) or []
    sampling: SamplingParams
    request_id: str = ""
    logprobs: int | None = None  # None: none; N: each emitted token's and N alternatives'
    prompt_logprobs: bool = False  # also score tokens[1:] (with the same N alternatives)
    decode_on: int = 0  # plain steps to take after the verdict (VerifyRequest.decode_on)
    stop_ids: frozenset[int] = frozenset()  # decoding on ends after one of these
    features_from: int | None = None  # return the features of added positions from here on
    feature_layers: tuple[int, ...] = ()  # ... with the residual after these layers first

    @classmethod
    def from_wire(cls, req, vocab_size: int) -> "VerifyCall":
        """Parse a VerifyRequest; ValueError names what is wrong."""
        sampling = SamplingParams.from_wire(req.sampling)
        tokens = list(req.tokens)
        drafts = list(req.draft_tokens)
        if not tokens:
            raise ValueError("tokens must not be empty: the block needs the token it follows")
        if len(drafts) > MAX_K:
            raise ValueError(f"a draft block holds at most {MAX_K} tokens, got {len(drafts)}")
        _check_ids(tokens, vocab_size, "tokens")
        _check_ids(drafts, vocab_size, "draft_tokens")
        if not (0 <= req.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {req.top_logprobs}")
        if req.decode_on > MAX_DECODE_ON:
            raise ValueError(f"decode_on must be in [0, {MAX_DECODE_ON}], got {req.decode_on}")
        _check_ids(list(req.stop_ids), vocab_size, "stop_ids")
        layers = tuple(int(x) for x in req.feature_layers)
        if layers and not req.return_features:
            raise ValueError("feature_layers asks for layers' features: set return_features")
        if list(layers) != sorted(set(layers)) or len(layers) > MAX_FEATURE_LAYERS:
            raise ValueError(f"feature_layers must be distinct and ascending, at most "
                             f"{MAX_FEATURE_LAYERS}; got {list(layers)}")
        dists: list[tuple[list[int], list[float]]] = []
        if not sampling.drafter_invariant:
            if len(req.draft_dists) != len(drafts):
                raise ValueError(
                    f"the rejection rule needs one draft distribution per draft token: "
                    f"{len(drafts)} tokens, {len(req.draft_dists)} draft_dists"
                )
            for i, d in enumerate(req.draft_dists):
                ids, probs = list(d.ids), list(d.probs)
                if len(ids) != len(probs):
                    raise ValueError(f"draft_dists[{i}]: ids and probs differ in length")
                _check_ids(ids, vocab_size, f"draft_dists[{i}].ids")
                if len(set(ids)) != len(ids):
                    raise ValueError(f"draft_dists[{i}]: ids repeat")
                if any(not (0.0 <= p <= 1.0) for p in probs) or sum(probs) > 1.001:
                    raise ValueError(f"draft_dists[{i}]: probs must be in [0, 1] and sum to <= 1")
                dists.append((ids, probs))
        return cls(
            session_id=req.session.session_id,
            prefix_len=int(req.session.prefix_len),
            prefix_hash=int(req.session.prefix_hash),
            tokens=tokens,
            draft_tokens=drafts,
            draft_dists=dists,
            sampling=sampling,
            request_id=req.request_id[:64],
            logprobs=int(req.top_logprobs) if req.logprobs or req.prompt_logprobs else None,
            prompt_logprobs=bool(req.prompt_logprobs),
            decode_on=int(req.decode_on),
            stop_ids=frozenset(req.stop_ids),
            features_from=int(req.features_from) if req.return_features else None,
            feature_layers=layers,
        )


def _check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in ids if not (0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"{what}: token ids must be in [0, {vocab_size}), got {bad[:5]}")


@dataclasses.dataclass
class VerifyResult:
    num_accepted: int
    next_token: int
    cache_len: int
    # per emitted token: (logprob, top ids, their logprobs); empty unless asked for
    logprobs: list[tuple[float, list[int], list[float]]] = dataclasses.field(
        default_factory=list)
    prompt_logprobs: list[tuple[float, list[int], list[float]]] = dataclasses.field(
        default_factory=list)  # of tokens[1:], when asked for
    decoded: list[int] = dataclasses.field(default_factory=list)  # decoded on after next_token
    passes: int = 1  # forward passes of the block and of each decoded token
    # with features_from: (position of the first row, [rows, (layers + 1) * hidden] float16
    # on the host)
    features: tuple[int, torch.Tensor] | None = None


# A coupled verdict races on the device off the CPU only (numpy's race, row by row, is cheaper
# there); tests set this to run the device's path on the CPU, where it must give the same.
DEVICE_VERDICT_ON_CPU = False


def greedy_rows(logits: torch.Tensor, raw: torch.Tensor, top: int | None):
    """Everything a greedy verdict emits, in one copy: each row's token is the argmax of
    ``logits`` [k + 1, vocab] (after penalties, biases and grammar); see ``emitted_rows``."""
    return emitted_rows(logits.argmax(-1), raw, top)


def emitted_rows(choice: torch.Tensor, raw: torch.Tensor, top: int | None,
                 valid: torch.Tensor | None = None):
    """Everything a verdict emits, fetched from the device in one copy: each row's token
    ``choice`` [k + 1] (on the device: the argmax, or the coupled race's winner) and, where
    ``top`` is not None, its log-probability under ``raw`` (the model's own log-softmax) with
    ``raw``'s ``top`` alternatives, as ``emitted_logprobs`` gives them. ``valid`` [k + 1]
    (bool) must hold at every row (a race over an all-zero row is not a sample). Returns
    (tokens, per-row logprobs or None). Ids travel as float64, exact below 2^53."""
    parts = [choice[:, None].double()]
    if valid is not None:
        parts.append(valid[:, None].double())
    if top is not None:
        logp = torch.log_softmax(raw.float(), dim=-1)
        parts.append(logp.gather(1, choice[:, None]).double())
        if top:
            values, ids = torch.topk(logp, top, dim=-1)
            parts += [ids.double(), values.double()]
    rows = torch.cat(parts, 1).tolist()
    if valid is not None:
        assert all(r[1] for r in rows), "cannot sample from an all-zero distribution"
        rows = [r[:1] + r[2:] for r in rows]
    tokens = [int(r[0]) for r in rows]
    if top is None:
        return tokens, None
    return tokens, [(r[1], [int(i) for i in r[2:2 + top]], r[2 + top:]) for r in rows]


def emitted_logprobs(logits: torch.Tensor, tokens: list[int], top: int):
    """(log p(token), top ids, top logprobs) of each row's token under the target's raw
    log-softmax. logits: [len(tokens), vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if top:
        values, ids = torch.topk(logp, top, dim=-1)
        return [(lp, i, v) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]
    return [(lp, [], []) for lp in chosen]


class VerifyWork(Work):
    """One verify call as scheduler work: prefill chunks, then the block in one pass, then
    (decode_on) plain steps, one a pass, each decided as a k = 0 call after it would be."""

    def __init__(self, call: VerifyCall, engine: LlamaEngine, store: SessionStore, vocab_size: int,
                 grammars: Grammars | None = None):
        super().__init__(call, engine, store, grammars)
        self.vocab_size = vocab_size
        self._feed = call.tokens + call.draft_tokens
        self._result: VerifyResult | None = None
        self._prompt_logprobs: list = []
        self._features: list[torch.Tensor] = []  # kept feature rows, in position order
        self._features_start: int | None = None

    def start(self) -> None:
        super().start()
        c = self.call
        total = c.prefix_len + len(self._feed)
        if total > self.engine.arch.max_context:
            raise ValueError(
                f"sequence of {total} tokens exceeds the target's context of "
                f"{self.engine.arch.max_context}"
            )
        beyond = [x for x in c.feature_layers if x >= self.engine.arch.num_layers]
        if beyond:
            raise ValueError(f"feature_layers {beyond}: the target has "
                             f"{self.engine.arch.num_layers} layers (0..."
                             f"{self.engine.arch.num_layers - 1})")

    def next_piece(self, budget: int) -> Piece | None:
        final = len(self.call.draft_tokens) + 1  # the block and the token it follows
        remaining = len(self._feed) - self._fed
        if remaining > final:  # prompt prefill, in chunks within the pass's budget
            if budget <= 0:
                return None
            n = min(budget, remaining - final)
            # scoring the prompt: every row of the chunk predicts the token after it
            prefill, num_logits = True, n if self.call.prompt_logprobs else 0
        else:
            n, prefill, num_logits = remaining, False, final
        self._piece_len = n
        chunk = torch.tensor(self._feed[self._fed : self._fed + n], dtype=torch.long)
        features = 0
        if self.call.features_from is not None:  # the piece's rows at features_from on
            end = self.call.prefix_len + self._fed + n
            features = max(0, min(n, end - self.call.features_from))
        return Piece(self.session.cache, chunk, num_logits, prefill, features,
                     self.call.feature_layers)

    def _keep_features(self, rows: int) -> None:
        """Keep the first ``rows`` of the piece's feature rows (those whose positions entered
        the cache)."""
        feats = self.piece_features
        if feats is None or rows <= 0:
            return
        if self._features_start is None:  # the piece's feature rows end at its last position
            self._features_start = self.call.prefix_len + self._fed + self._piece_len - \
                feats.shape[0]
        self._features.append(feats[:rows])

    def consume(self, logits: torch.Tensor) -> bool:
        c = self.call
        if c.prompt_logprobs and self._fed < len(c.tokens) - 1:
            # rows of committed tokens (this piece's, or the final piece's first) score the
            # committed token after each
            rows = min(self._piece_len, len(c.tokens) - 1 - self._fed)
            nxt = self._feed[self._fed + 1: self._fed + 1 + rows]
            self._prompt_logprobs += emitted_logprobs(
                self.engine.full_vocab_logits(logits[:rows], self.vocab_size), nxt,
                c.logprobs or 0)
        if self._fed + self._piece_len < len(self._feed):  # a prefill chunk: all kept
            self._keep_features(len(self.piece_features) if self.piece_features is not None
                                else 0)
            self._fed += self._piece_len
            return False
        num_accepted, next_token, emitted_lp = self._verdict(logits)
        if self.piece_features is not None:  # the final piece: up to the last accepted row
            kept_end = self.call.prefix_len + len(self.call.tokens) + num_accepted
            first_row = self.call.prefix_len + self._fed + self._piece_len - \
                self.piece_features.shape[0]
            self._keep_features(kept_end - first_row)
        self._fed += self._piece_len
        if self._result is None:
            self._result = VerifyResult(num_accepted, next_token, len(self.session), emitted_lp,
                                        self._prompt_logprobs)
        else:  # a step decoded on
            self._result.decoded.append(next_token)
            self._result.logprobs += emitted_lp
            self._result.cache_len = len(self.session)
            self._result.passes += 1
        if self._decoding_on(next_token):
            # the next pass is the plain step a k = 0 call with tokens = [next_token] would take
            self.call = dataclasses.replace(
                c, prefix_len=len(self.session), tokens=[next_token], draft_tokens=[],
                draft_dists=[], prompt_logprobs=False, decode_on=c.decode_on - 1)
            self._feed, self._fed = [next_token], 0
            return False
        self.session.compute_s += self.compute_s
        if self._features:  # one copy to the host for the call (float16's range: see Features)
            self._result.features = (self._features_start,
                                     half_features(torch.cat(self._features)).cpu())
        return True

    def _decoding_on(self, token: int) -> bool:
        c = self.call
        if c.decode_on <= 0 or token in c.stop_ids or \
                len(self.session) + 2 > self.engine.arch.max_context:
            return False
        if self.grammar is not None:  # a grammar that token completes ends the output
            self.grammar.sync(self.session.tokens + [token])
            return not self.grammar.matcher.is_terminated()
        return True

    def _verdict(self, logits: torch.Tensor) -> tuple[int, int, list]:
        """Apply the acceptance rule to the block's logits [k + 1, vocab], commit the accepted
        tokens to the session: (num_accepted, next_token, the emitted tokens' logprobs)."""
        c = self.call
        k = len(c.draft_tokens)
        logits = self.engine.full_vocab_logits(logits, self.vocab_size)  # [k + 1, vocab]
        drafts = torch.tensor(c.draft_tokens, dtype=torch.long)
        first = c.prefix_len + len(c.tokens)  # position of the first draft token
        raw = logits  # logprobs are the model's own
        committed = self.session.tokens[: c.prefix_len] + c.tokens
        logits = penalize(logits, c.sampling, committed, c.draft_tokens)
        logits = bias_logits(logits, c.sampling, self.vocab_size)
        grammar = self.grammar
        if grammar is not None:  # row j: the grammar after the committed tokens and d_1..d_j
            logits = mask_logits(logits, block_masks(grammar, committed, c.draft_tokens))
        rows = None  # the logprobs fetched with the tokens (greedy; coupled on the device)
        if c.sampling.greedy:
            targets, rows = greedy_rows(logits, raw, c.logprobs)
            num_accepted, next_token = verify_walk(c.draft_tokens, targets)
        elif c.sampling.rule == "coupled":
            target_probs = process_logits(logits, c.sampling)  # [k + 1, vocab]
            if logits.device.type != "cpu" or DEVICE_VERDICT_ON_CPU:
                # every row's race on the device, fetched with the logprobs in one copy
                choice, race = coupled_race(target_probs, c.sampling.seed, first)
                targets, rows = emitted_rows(choice, raw, c.logprobs, valid=race > 0)
                num_accepted, next_token = verify_walk(c.draft_tokens, targets)
            else:
                num_accepted, next_token = verify_coupled(drafts, target_probs,
                                                          c.sampling.seed, first)
        else:
            target_probs = process_logits(logits, c.sampling)  # [k + 1, vocab]
            draft_probs = (
                torch.stack([from_sparse(i, p, self.vocab_size) for i, p in c.draft_dists])
                if k
                else torch.zeros(0, self.vocab_size)
            )  # [k, vocab]
            gens = [position_generator(c.sampling.seed, first + i, "target") for i in range(k + 1)]
            num_accepted, next_token = verify_rejection(drafts, draft_probs, target_probs, gens)
        kept = c.tokens + c.draft_tokens[:num_accepted]
        if grammar is not None:  # the rejected draft tokens leave the matcher (rollback)
            grammar.sync(committed + c.draft_tokens[:num_accepted])
        self.session.append(kept)
        self.session.calls += 1
        self.session.tokens_in += len(c.tokens)
        self.session.proposed += k
        self.session.accepted += num_accepted
        self.session.cache.truncate(c.prefix_len + len(kept))
        emitted = c.draft_tokens[:num_accepted] + [next_token]
        if rows is not None:  # (the emitted tokens are the rows' own choices)
            logprobs = rows[: num_accepted + 1]
        else:  # (rejection: the tokens are known after the verdict's reads, so another)
            logprobs = ([] if c.logprobs is None else
                        emitted_logprobs(raw[: num_accepted + 1], emitted, c.logprobs))
        return num_accepted, next_token, logprobs

    def result(self) -> VerifyResult:
        assert self._result is not None
        return self._result

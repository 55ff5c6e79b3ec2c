"""A feature-conditioned draft (EAGLE-style, ``specdec.models.feature_model``) served like any
draft model: the scheduler, ``DraftWork`` and ``BranchWork`` drive it through the engine calls
they make of a ``LlamaEngine`` (``new_cache``, ``forward``, ``token_ids``, ...), and each
session's cache also holds the target's features the orchestrator sent (DraftRequest.features).

Rows. The draft's row for token position t reads (the target's feature of position t - 1,
token t) and gives the logits of token t + 1 and its own prediction of the feature of
position t. A session's rows start just after its first feature (position s: the prompt's
last, so row s + 1 is the first answer token's, as the draft was trained). A row whose feature
the target has not sent reads the previous row's prediction instead (the block in flight,
drafted tokens, the speculation cache's branches), or zeros for a first row before any feature
came (the first round's draft calls); a draft that reads target layers beside the final
feature (``FeatureDraft.feature_layers``) reads them there as their means. Such rows are
provisional: once the target's feature for one of them arrives they are computed again from
there, so what the draft has seen of the accepted tokens is always the target's. Rows are
computed when logits are asked for, the leading ones whose features are known in one step,
the others one by one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdec.config import DEFAULT_NUMERICS
from specdec.models.draft_model import LAYER_PARAMS
from specdec.models.feature_model import FeatureDraft, read_features
from specdec.serving.engine import LlamaEngine
from specdec.serving.kernels import GroupedCodes, Linear, timed
from specdec.serving.session import PrefixMismatch


FP16_MAX = float(torch.finfo(torch.float16).max)


def half_features(rows: torch.Tensor) -> torch.Tensor:
    """Feature rows as the wire carries them (and the data keeps them): float16, a value
    beyond its range saturated (a residual stream may hold one; a final feature does not)."""
    return rows.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def wire_features(msg, tokens_end: int) -> tuple[int, torch.Tensor] | None:
    """A Features message as (start, [rows, dim] float32), None when empty; ValueError names
    what is wrong. ``tokens_end``: the request's sequence length (prefix + tokens); a feature
    predicts the token after it, so rows reach at most position tokens_end - 2."""
    if not msg.data:
        return None
    dim = int(msg.dim)
    if dim <= 0 or len(msg.data) % (2 * dim):
        raise ValueError(f"features: data must hold rows of dim = {dim} float16 values "
                         f"({len(msg.data)} bytes)")
    rows = len(msg.data) // (2 * dim)
    start = int(msg.start)
    if start + rows > tokens_end - 1:
        raise ValueError(f"features: rows of positions {start}..{start + rows - 1} reach past "
                         f"the request's tokens (a feature predicts the token after it: at "
                         f"most position {tokens_end - 2})")
    values = np.frombuffer(msg.data, dtype="<f2").reshape(rows, dim).astype(np.float32)
    if not np.isfinite(values).all():
        raise ValueError("features: values must be finite")
    return start, torch.from_numpy(values)


@dataclasses.dataclass
class FeatureCache:
    """One session's state in a feature draft: its tokens, the target's features it was sent,
    and the draft's rows (keys and values, each row's predicted feature)."""

    hidden: int  # the draft's predicted features' width
    device: torch.device = torch.device("cpu")
    width: int = 0  # the target's features' width (0: hidden; more with tapped layers)
    tokens: list[int] = dataclasses.field(default_factory=list)
    feat_start: int | None = None  # position of the first feature sent
    feats: torch.Tensor | None = None  # [n, width]: features of positions feat_start..
    rows: object = None  # the stack's KV cache (KVCache / PooledCache): one position a row
    row_start: int = 0  # token position of row 0
    true_rows: int = 0  # leading rows that read the target's features
    preds: torch.Tensor | None = None  # [rows, hidden]: each row's predicted feature

    def __post_init__(self) -> None:
        self.width = self.width or self.hidden
        if self.feats is None:
            self.feats = torch.empty(0, self.width, device=self.device)
        if self.preds is None:
            self.preds = torch.empty(0, self.hidden, device=self.device)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def feat_end(self) -> int:
        """Features are known for positions feat_start .. feat_end - 1."""
        return 0 if self.feat_start is None else self.feat_start + self.feats.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + (self.feats.numel() + self.preds.numel()) * 4

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens, the features and rows they determine."""
        del self.tokens[length:]
        if self.feat_start is not None:
            self.feats = self.feats[: max(0, length - self.feat_start)]
        self.cut_rows(max(0, min(self.rows.length, length - self.row_start)))

    def cut_rows(self, n: int) -> None:
        self.rows.truncate(n)
        self.preds = self.preds[:n]
        self.true_rows = min(self.true_rows, n)

    def fork(self, length: int) -> "FeatureCache":
        """An independent cache of the first ``length`` tokens (the speculation cache's
        branches): the rows they determine copied, features and predictions shared (never
        written in place)."""
        copy = dataclasses.replace(self, tokens=list(self.tokens),
                                   rows=self.rows.fork(max(0, min(self.rows.length,
                                                                  length - self.row_start))))
        copy.truncate(length)
        return copy

    def add_features(self, start: int, feats: torch.Tensor) -> None:
        """Features of positions start.. (rows [n, width]); they continue (or overlap) the
        ones held, else PrefixMismatch (the orchestrator then re-sends the session)."""
        if feats.shape[1] != self.width:
            raise ValueError(f"features: this draft reads features of dim {self.width}, got "
                             f"{feats.shape[1]} (a draft made for another target, or the "
                             "target asked for other layers?)")
        feats = feats.to(self.device)
        if self.feat_start is None:
            self.feat_start, self.feats = start, feats
            return
        if not self.feat_start <= start <= self.feat_end:
            raise PrefixMismatch(f"features from position {start}: the draft holds features "
                                 f"of positions {self.feat_start}..{self.feat_end - 1}")
        self.feats = torch.cat([self.feats[: start - self.feat_start], feats])
        # rows that read a feature at start or later were computed before it came (again)
        self.true_rows = min(self.true_rows, max(0, start + 1 - self.row_start))


@dataclasses.dataclass
class _Rows:
    """A session's rows to compute in a forward: from token position ``next`` to its end."""

    cache: FeatureCache
    out: torch.Tensor  # [wanted, vocab_out]: the logits asked for (the last positions)
    next: int
    logits: list = dataclasses.field(default_factory=list)  # of the rows computed


class FeatureEngine:
    """A feature draft behind the engine interface the draft's works use.

    Its layer, final norm and head run as a one-layer ``LlamaEngine`` (the ``stack``: the same
    kernels, int8 codes and numerics as any specdec draft on this device, its keys and values
    in the stack's caches), fed the fc's rows instead of token embeddings; the stack's
    features (its final norm's output) are the draft's predicted features. The fc and the
    scaled embedding lookup run in torch; so does standardising the target layers' rows of a
    draft that reads them (``feature_layers``, ``tap_mean`` / ``tap_std`` [layers, hidden])."""

    reads_features = True
    pool = None  # the scheduler admits every piece (the stack keeps its own caches)

    def __init__(self, stack: LlamaEngine, fc_weight: torch.Tensor, fc_bias: torch.Tensor,
                 feature_scale: float, fc_codes: GroupedCodes | None = None,
                 feature_layers: tuple[int, ...] = (), tap_mean: torch.Tensor | None = None,
                 tap_std: torch.Tensor | None = None):
        self.stack = stack
        self.device = stack.device
        self.arch = stack.arch
        self.numerics = stack.numerics
        self.hidden = stack.arch.hidden_size
        self.vocab_map = stack.vocab_map
        self.vocab_in = stack.vocab_in
        self.vocab_out = stack.vocab_out
        # on the stack's kernels (and its stored codes): in integer numerics a row's numbers
        # are the same in any pass, as the stack's
        self.fc = Linear(fc_weight.to(self.device, stack.dtype),
                         fc_bias.to(self.device, stack.dtype), stack.kernels,
                         fc_codes if stack.kernels is not None else None,
                         integer=stack.numerics == "integer")
        self.feature_scale = float(feature_scale)
        self.embed_scale = float(stack.embed.float().pow(2).mean().sqrt())
        self.feature_layers = tuple(feature_layers)
        self.feature_width = (len(self.feature_layers) + 1) * self.hidden
        no_taps = torch.empty(0, self.hidden)
        self.tap_mean = (no_taps if tap_mean is None else tap_mean).float().to(self.device)
        self.tap_std = (no_taps if tap_std is None else tap_std).float().to(self.device)

    @classmethod
    def from_module(cls, draft: FeatureDraft, device="cpu", kernels: str = "auto",
                    numerics: str = DEFAULT_NUMERICS, codes: dict | None = None,
                    dtype: torch.dtype | None = None) -> "FeatureEngine":
        """Serve ``draft`` (``codes``: its stored int8 matrices by their names in the module,
        ``draft_model.stored_codes``; without them it computes float32)."""
        if draft.feature_out != "norm":
            raise ValueError("a served feature draft predicts the feature its head reads "
                             "(feature_out 'norm'), not its residual")
        weights = {"embed": draft.embed, "norm": draft.params["norm"],
                   "head": draft.params["head"]}
        weights.update({f"layers.0.{n}": draft.params[n] for n in LAYER_PARAMS})
        weights = {k: v.detach().float() for k, v in weights.items()}
        codes = dict(codes or {})
        fc_codes = codes.pop("fc.weight", None)
        codes = {("layers.0." + k if k in LAYER_PARAMS else k): c for k, c in codes.items()}
        stack = LlamaEngine(draft.arch, weights, device, kernels, vocab_map=draft.vocab_map,
                            codes=codes, numerics=numerics, dtype=dtype)
        return cls(stack, draft.fc.weight.detach().float(), draft.fc.bias.detach().float(),
                   float(draft.feature_scale), fc_codes, draft.feature_layers, draft.tap_mean,
                   draft.tap_std)

    @classmethod
    def load(cls, path, device="cpu", kernels: str = "auto", numerics: str = DEFAULT_NUMERICS,
             dtype: torch.dtype | None = None) -> "FeatureEngine":
        """A feature draft directory (``feature_model.save_draft``); on CPU in float32 its
        stored int8 matrices stream as they are, as a plain draft's do."""
        from specdec.models import draft_model, feature_model

        stored = draft_model.load_stored(path)  # read once: the module's weights and codes
        codes = None
        if torch.device(device).type == "cpu" and dtype in (None, torch.float32):
            codes = draft_model.stored_codes(stored[1])
        return cls.from_module(feature_model.load_draft(path, stored), device, kernels,
                               numerics, codes, dtype)

    token_ids = LlamaEngine.token_ids
    full_vocab_logits = LlamaEngine.full_vocab_logits

    def new_cache(self) -> FeatureCache:
        return FeatureCache(self.hidden, self.device, self.feature_width,
                            rows=self.stack.new_cache())

    def reserve_kv(self, cap_bytes: int) -> None:
        """The stack's pool where it keeps one (torch's ops: sized by the service's cap);
        the scheduler does not admit by it (None)."""
        self.stack.reserve_kv(cap_bytes)
        return None

    @torch.inference_mode()
    def forward(self, caches, tokens, num_logits) -> list[torch.Tensor]:
        """Append each session's tokens; its logits [num_logits[i], vocab_out] for its last
        positions (zeros for a position before the session's first row). The sessions' rows
        are batched: those on the target's features in one stack pass, then one pass per
        row that reads a prediction (a drafting pass has one such row per session)."""
        out, todo = [], []
        for cache, toks, n in zip(caches, tokens, num_logits):
            cache.tokens += toks.tolist()
            out.append(torch.zeros(n, self.vocab_out, device=self.device))
            if n:
                todo.append(_Rows(cache, out[-1], self._first_row(cache, n)))
        known = []
        for r in todo:  # the leading rows whose features the target sent
            c = r.cache
            if c.feat_start is not None and c.true_rows == c.rows.length:
                n = max(0, min(c.length, c.feat_end + 1) - r.next)
                if n:
                    at = r.next - 1 - c.feat_start
                    known.append((r, c.feats[at:at + n], n))
        self._pass(known, true=True)
        while True:  # the rest, a row at a time, each on its session's last prediction
            step = [(r, r.cache.preds[-1:] if r.cache.preds.shape[0] else
                     torch.zeros(1, self.hidden, device=self.device), 1)
                    for r in todo if r.next < r.cache.length]
            if not step:
                break
            self._pass(step, true=False)
        for r in todo:
            got = torch.cat(r.logits) if r.logits else r.out[:0]
            take = min(r.out.shape[0], got.shape[0])
            if take:
                r.out[r.out.shape[0] - take:] = got[got.shape[0] - take:]
        return out

    def forward_features(self, caches, tokens, num_logits, num_features=None):
        raise ValueError("a feature draft has no features to give")

    @staticmethod
    def _first_row(cache: FeatureCache, wanted: int) -> int:
        """Make the session's rows valid for what it knows now; the token position of its
        next row to compute."""
        if cache.feat_start is not None and cache.row_start != cache.feat_start + 1:
            cache.cut_rows(0)  # features came: rows start where the draft learnt them
            cache.row_start = cache.feat_start + 1
        elif cache.feat_start is None and cache.rows.length == 0:
            cache.row_start = max(0, cache.length - wanted)  # rows only where logits are asked
        # a provisional row whose feature the target has sent since is computed again
        # (row i reads the feature of position row_start + i - 1)
        if cache.feat_start is not None and cache.true_rows < cache.rows.length and \
                cache.row_start + cache.true_rows - 1 < cache.feat_end:
            cache.cut_rows(cache.true_rows)
        return cache.row_start + cache.rows.length

    def _pass(self, rows: list[tuple["_Rows", torch.Tensor, int]], true: bool) -> None:
        """One stack pass over sessions' next rows: (session, features [n, width] or
        predicted [n, hidden], n) each; ``true``: the features are the target's."""
        if not rows:
            return
        toks = [torch.tensor(r.cache.tokens[r.next:r.next + n], dtype=torch.long,
                             device=self.device) for r, _, n in rows]
        feats = read_features(torch.cat([f.float() for _, f, _ in rows]), self.feature_scale,
                              self.tap_mean, self.tap_std)
        embeds = self.stack.embed[torch.cat(toks)].float() / self.embed_scale
        x = self.fc(torch.cat([feats, embeds], -1).to(self.stack.dtype).contiguous())
        sizes = [n for _, _, n in rows]
        logits, preds = self.stack.forward_features([r.cache.rows for r, _, _ in rows], toks,
                                                    sizes, inputs=list(x.split(sizes)))
        for (r, _, n), lg, pred in zip(rows, logits, preds):
            r.cache.preds = torch.cat([r.cache.preds, pred.float()])
            if true:
                r.cache.true_rows += n
            r.logits.append(lg)
            r.next += n

    def forward_timer(self, context: int = 128, max_rows: int = 16):
        """ms(rows) of one step over ``rows`` new rows after ``context`` rows of features (the
        cache cut back to the context before each probe), as start-up calibration asks."""
        cache = self.new_cache()
        tokens = (torch.arange(context + max_rows + 1) % self.vocab_in).tolist()
        cache.add_features(0, torch.zeros(context + max_rows, self.feature_width))
        self.forward([cache], [torch.tensor(tokens[:context + 1])], [1])

        def probe(rows: int) -> float:
            cache.truncate(context + 1)  # (and the features with it: those of the probe again)
            cache.add_features(context, torch.zeros(max_rows + 1, self.feature_width))
            feed = torch.tensor(tokens[context + 1:context + 1 + rows])
            return timed(lambda: self.forward([cache], [feed], [rows]))

        return probe

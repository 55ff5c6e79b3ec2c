"""The feature-conditioned draft's model (EAGLE-1 style): its recipe, the module, its serving
cache and the chain mask its training and evaluation use. How it reads the target's features,
and how it is trained and evaluated: ``specdec.distill.feature_draft``."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models import draft_model
from specdec.models.draft_model import LAYER_PARAMS, target_weights
from specdec.serving.arch import ArchConfig, rope_inv_freq


@dataclasses.dataclass
class FeatureRecipe:
    target: str = "default"
    init_layer: int = -1  # target layer the draft's layer starts from (negative: from the end)
    random_layer: bool = False  # start the layer from random weights instead
    fc_init: str = "identity"  # fc starts as [I, I] (feature + token embedding), or "random"
    feature_out: str = "norm"  # predicted feature: "norm" = the draft's RMSNorm output (what
    # its head reads; norm starts as the target's final norm) or "residual" = the layer output
    freeze_head: bool = False  # keep the head at the target's embedding rows (as EAGLE does)
    vocab: int = 8192
    max_answer: int = 192  # rows per record kept (answers are at most 192 tokens anyway)
    batch: int = 8  # records per step
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    feature_weight: float = 5.0  # weight of the smooth-L1 feature regression (on scaled
    # features); 5 beat 1 at every step (held-out step 1, 2: 0.257, 0.238 vs 0.251, 0.180)
    noise: float = 0.0  # uniform noise on input features, +- this times the feature RMS
    unroll: int = 1  # passes trained per step: 1 = teacher forced; 2-3 = own features fed
    unroll_detach: bool = False  # stop gradients through the fed predicted features
    feature_layers: str = ""  # target layers whose residual stream the draft also reads,
    # comma-separated ("2,14": low and middle, beside the final feature, as EAGLE-3 fuses them)
    seed: int = 0

    @property
    def layers(self) -> tuple[int, ...]:
        return parse_layers(self.feature_layers)


def parse_layers(text: str) -> tuple[int, ...]:
    """"2,14" -> (2, 14): target layers, ascending and distinct (ValueError otherwise)."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"feature layers: comma-separated layer numbers, not {text!r}") from None
    if list(layers) != sorted(set(layers)) or any(x < 0 for x in layers):
        raise ValueError(f"feature layers: distinct, ascending, >= 0; got {text!r}")
    return layers


# -- model ------------------------------------------------------------------------------------


@dataclasses.dataclass
class DraftCache:
    """The draft's own keys and values, [1, kv_heads, length, head_dim] each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, length: int) -> None:
        """Drop rows from ``length`` on (after the target rejected drafted tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def chain_mask(passes: int, t: int, device=None) -> torch.Tensor:
    """[passes * t, passes * t] bool: query (pass s, row r) may attend key (pass u, row j).

    Pass 1 is causal over true rows. A row of pass s >= 2 is step s of the chain that started
    at true row c = r - s + 1: it sees true rows j <= c and, of each pass u = 2..s, row c+u-1.
    """
    r = torch.arange(t, device=device)
    blocks = []
    for s in range(1, passes + 1):
        row = []
        c = r - s + 1  # chain start of each query row
        for u in range(1, passes + 1):
            j = r[None, :]
            if u == 1:
                m = j <= c[:, None]
            elif u <= s:
                m = j == (c + u - 1)[:, None]
            else:
                m = torch.zeros(t, t, dtype=torch.bool, device=device)
            row.append(m)
        blocks.append(torch.cat(row, 1))
    return torch.cat(blocks, 0)  # every query sees at least itself (pass s, row r)


def read_features(features: torch.Tensor, scale, tap_mean: torch.Tensor,
                  tap_std: torch.Tensor) -> torch.Tensor:
    """Features as the draft's fc reads them: [..., (layers + 1) * hidden] (the target's: its
    layers' residual rows, then its final feature) or [..., hidden] (the draft's own predicted
    final feature, where the target's is not known: the layers' rows then read as their
    means) -> [..., (layers + 1) * hidden]: the layers' rows standardised by ``tap_mean`` /
    ``tap_std`` [layers, hidden], then the final feature over ``scale``."""
    hidden = tap_mean.shape[-1]
    final = features[..., -hidden:] / scale
    if not tap_mean.shape[0]:
        return final
    if features.shape[-1] == hidden:
        taps = final.new_zeros(*final.shape[:-1], tap_mean.numel())
    else:
        taps = ((features[..., :-hidden].unflatten(-1, (-1, hidden)) - tap_mean)
                / tap_std).flatten(-2)
    return torch.cat([taps, final], -1)


class FeatureDraft(nn.Module):
    """fc([feature; embed(token)]) -> one Llama layer -> (RMSNorm -> head, predicted feature).

    ``embed`` (the target's input embedding) is a frozen buffer, not stored with the draft.
    ``feature_scale``: the RMS of the target's features (regression loss and noise are scaled
    by it; with ``feature_out="residual"`` the output norm starts at it). The fc reads the
    feature and the embedding each divided by its RMS: SmolLM2's embeddings are ~15x smaller
    than its features, and unscaled the token was drowned (held-out step-1 agreement 0.16 /
    0.13 against 0.22 / 0.21 scaled, templated / handwritten, 200 steps on 62k rows).

    ``feature_layers``: target layers whose residual stream (after the layer) the draft reads
    too, each row's input then [tap rows of those layers; final feature], the taps each
    dimension standardised by ``tap_mean`` / ``tap_std`` [len(layers), hidden] (SmolLM2's
    layer 14 has channels of RMS ~1,700 beside ~9 for the rest). A row on the draft's own
    predicted feature (a chained row) has no taps: it reads them as their means (zeros once
    standardised). The fc then starts as the one-feature draft, the taps' columns near zero.
    """

    def __init__(self, arch: ArchConfig, embed: torch.Tensor, vocab_map: torch.Tensor,
                 feature_scale: float = 1.0, feature_out: str = "norm",
                 feature_layers: tuple[int, ...] = ()):
        super().__init__()
        if feature_out not in ("norm", "residual"):
            raise ValueError(f"feature_out: norm or residual, not {feature_out!r}")
        self.feature_out = feature_out
        beyond = [f for f in arch.features() if f != "rope_scaling"]
        if beyond:
            raise ValueError(f"the feature draft models a Llama block; target has {beyond}")
        self.arch = a = arch
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("vocab_map", vocab_map.long())
        self.register_buffer("feature_scale", torch.tensor(float(feature_scale)))
        self.register_buffer("embed_scale", embed.float().pow(2).mean().sqrt(), persistent=False)
        self.feature_layers = tuple(feature_layers)
        taps = len(self.feature_layers)
        # (stored only with taps: a one-feature draft's state is what it always was)
        self.register_buffer("tap_mean", torch.zeros(taps, a.hidden_size), persistent=bool(taps))
        self.register_buffer("tap_std", torch.ones(taps, a.hidden_size), persistent=bool(taps))
        self.fc = nn.Linear((taps + 2) * a.hidden_size, a.hidden_size, bias=True)
        self.params = nn.ParameterDict({
            "attn_norm": nn.Parameter(torch.ones(a.hidden_size)),
            "wqkv": nn.Parameter(torch.randn((hq + 2 * hkv) * d, a.hidden_size) * 0.02),
            "wo": nn.Parameter(torch.randn(a.hidden_size, hq * d) * 0.02),
            "mlp_norm": nn.Parameter(torch.ones(a.hidden_size)),
            "w_gate_up": nn.Parameter(torch.randn(2 * a.intermediate_size, a.hidden_size) * 0.02),
            "w_down": nn.Parameter(torch.randn(a.hidden_size, a.intermediate_size) * 0.02),
            "norm": nn.Parameter(torch.full((a.hidden_size,), float(feature_scale))),
            "head": nn.Parameter(torch.randn(len(vocab_map), a.hidden_size) * 0.02),
        })
        inv_freq = rope_inv_freq(a.rope_theta, a.rope_scaling, d, a.max_context)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # pieces

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps))

    @property
    def feature_width(self) -> int:
        """Numbers a row reads of the target: its taps and its final feature."""
        return (len(self.feature_layers) + 1) * self.arch.hidden_size

    def rows(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input rows: fc([taps; feature; embed(token)]), each part at unit RMS
        (``read_features``)."""
        return self.fc(torch.cat([read_features(features, self.feature_scale, self.tap_mean,
                                                self.tap_std),
                                  self.embed[tokens] / self.embed_scale], -1))

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """x [b, t, hidden], pos [t] -> q [b, hq, t, d], k and v [b, hkv, t, d] (RoPE'd)."""
        a = self.arch
        b, t, _ = x.shape
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        h = self._norm(x, self.params["attn_norm"])
        q, k, v = F.linear(h, self.params["wqkv"]).split([hq * d, hkv * d, hkv * d], -1)
        ang = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]

        def rope(z):
            z1, z2 = z.chunk(2, -1)
            return z * cos + torch.cat((-z2, z1), -1) * sin

        q = rope(q.view(b, t, hq, d).transpose(1, 2))
        k = rope(k.view(b, t, hkv, d).transpose(1, 2))
        return q, k, v.view(b, t, hkv, d).transpose(1, 2)

    def _finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Attention output o [b, hq, t, d] -> h [b, t, hidden] (residual, MLP)."""
        b, _, t, _ = o.shape
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), self.params["wo"])
        gate, up = F.linear(self._norm(x, self.params["mlp_norm"]), self.params["w_gate_up"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, self.params["w_down"])

    def outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer output h -> (logits over the draft vocabulary, predicted next feature)."""
        y = self._norm(h, self.params["norm"])
        return F.linear(y, self.params["head"]), (y if self.feature_out == "norm" else h)

    # whole sequences (training, evaluation)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, passes: int = 1,
                noise: float = 0.0, detach: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [b, t, feature_width] (the target's, row t), tokens [b, t] (emitted at
        row t).

        Returns per pass s = 1..passes (logits [b, t, vocab_out], h [b, t, hidden]): pass s at
        row r is step s of the chain started at true row r - s + 1 (valid for r >= s - 1).
        ``noise``: uniform noise on the true input final features (+- noise * feature RMS).
        """
        b, t, _ = features.shape
        a = self.arch
        pos = torch.arange(t, device=features.device)
        if noise > 0:
            h = a.hidden_size
            final = features[..., -h:]
            final = final + (torch.rand_like(final) * 2 - 1) * noise * self.feature_scale
            features = torch.cat([features[..., :-h], final], -1)
        xs, qs, ks, vs = [], [], [], []
        outs = []
        feed = features
        for s in range(1, passes + 1):
            x = self.rows(feed, tokens)
            q, k, v = self._qkv(x, pos)
            xs.append(x), qs.append(q), ks.append(k), vs.append(v)
            if s == 1:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   enable_gqa=a.num_heads != a.num_kv_heads)
            else:
                mask = chain_mask(s, t, features.device)[(s - 1) * t:]  # this pass's queries
                o = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2),
                                                   attn_mask=mask,
                                                   enable_gqa=a.num_heads != a.num_kv_heads)
            h = self._finish(x, o)
            logits, pred = self.outputs(h)
            outs.append((logits, pred))
            if s < passes:  # next pass, row r: fed the prediction of row r - 1
                prev = pred.detach() if detach else pred
                feed = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
        return outs

    # serving: token by token over the draft's own cache

    def new_cache(self) -> DraftCache:
        return DraftCache()

    @torch.no_grad()
    def step(self, cache: DraftCache, features: torch.Tensor, tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows (features [n, feature_width], tokens [n]) to ``cache``; return their logits
        over the draft vocabulary [n, vocab_out] and predicted next features [n, hidden].

        After the target verifies, truncate the cache to the accepted rows and append those
        again with the target's true features; drafted rows use the draft's own features.
        """
        n = tokens.shape[0]
        x = self.rows(features[None].float(), tokens[None])
        pos = torch.arange(cache.length, cache.length + n, device=x.device)
        q, k, v = self._qkv(x, pos)
        cache.k = k if cache.k is None else torch.cat([cache.k, k], 2)
        cache.v = v if cache.v is None else torch.cat([cache.v, v], 2)
        total = cache.length
        mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
        o = F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=mask,
                                           enable_gqa=self.arch.num_heads != self.arch.num_kv_heads)
        h = self._finish(x, o)
        logits, pred = self.outputs(h)
        return logits[0], pred[0]

    def token_ids(self, out_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_map[out_ids]


def init_from_target(recipe: FeatureRecipe, vocab_map: torch.Tensor, feature_scale: float,
                     model=None, tap_stats: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> FeatureDraft:
    """A FeatureDraft with the layer from target layer ``recipe.init_layer`` and the head from
    the target's (tied) embedding rows of the draft vocabulary; with ``recipe.layers``, its
    taps standardised by ``tap_stats`` (mean, std [layers, hidden]:
    ``feature_draft.tap_stats``)."""
    arch_t, weights = target_weights(recipe.target, model)
    arch = dataclasses.replace(arch_t, num_layers=1)
    layers = recipe.layers
    if any(x >= arch_t.num_layers for x in layers):
        raise ValueError(f"feature layers {layers}: the target has {arch_t.num_layers} layers")
    draft = FeatureDraft(arch, weights["embed"].float().clone(), vocab_map, feature_scale,
                         recipe.feature_out, layers)
    with torch.no_grad():
        if layers:
            draft.tap_mean.copy_(tap_stats[0])
            draft.tap_std.copy_(tap_stats[1])
        draft.params["head"].copy_(weights["head"][vocab_map])
        if recipe.feature_out == "norm":  # its output is then the target's kind of feature
            draft.params["norm"].copy_(weights["norm"])
        if recipe.fc_init == "identity":  # features and (tied) embeddings share one basis
            h = arch.hidden_size
            taps = torch.zeros(h, len(layers) * h)  # the taps' columns start near zero
            draft.fc.weight.copy_(torch.cat([taps, torch.eye(h), torch.eye(h)], 1))
            draft.fc.weight.add_(torch.randn_like(draft.fc.weight) * 0.01)
            draft.fc.bias.zero_()
        elif recipe.fc_init != "random":
            raise ValueError(f"fc_init: identity or random, not {recipe.fc_init!r}")
        if not recipe.random_layer:
            src = recipe.init_layer % arch_t.num_layers
            for name in LAYER_PARAMS:
                draft.params[name].copy_(weights[f"layers.{src}.{name}"])
    draft.params["head"].requires_grad_(not recipe.freeze_head)
    return draft


# -- specdec's draft format -------------------------------------------------------------------


def save_draft(path, draft: FeatureDraft, target: str, card: dict) -> None:
    """Write ``draft`` as a specdec draft directory (``draft_model.save``, kind "feature"):
    its matrices int8 per row, the embedding left to the target."""
    weights = dict(draft.params.items())
    weights.update({"fc.weight": draft.fc.weight, "fc.bias": draft.fc.bias,
                    "feature_scale": draft.feature_scale})
    extra = {"kind": draft_model.FEATURE, "feature_out": draft.feature_out}
    if draft.feature_layers:  # (flat: vectors are stored as they are, matrices as int8)
        weights.update({"tap_mean": draft.tap_mean.flatten(), "tap_std": draft.tap_std.flatten()})
        extra["feature_layers"] = list(draft.feature_layers)
    draft_model.save(path, draft.arch, weights, draft.vocab_map, target, card, meta_extra=extra)


def load_draft(path, stored: tuple[dict, dict] | None = None) -> FeatureDraft:
    """A feature draft directory (``save_draft``) as the module, its weights as stored
    (``stored``: ``draft_model.load_stored(path)``, where already read)."""
    meta, weights = draft_model.load_weights(path, stored)
    if meta.get("kind") != draft_model.FEATURE:
        raise ValueError(f"{path}: not a feature draft (kind {meta.get('kind')!r})")
    draft = FeatureDraft(ArchConfig(**meta["arch"]), weights.pop("embed").float(),
                         weights.pop("vocab_map").long(), float(weights.pop("feature_scale")),
                         meta.get("feature_out", "norm"), tuple(meta.get("feature_layers", ())))
    with torch.no_grad():
        if draft.feature_layers:
            draft.tap_mean.copy_(weights.pop("tap_mean").view_as(draft.tap_mean))
            draft.tap_std.copy_(weights.pop("tap_std").view_as(draft.tap_std))
        draft.fc.weight.copy_(weights.pop("fc.weight"))
        draft.fc.bias.copy_(weights.pop("fc.bias"))
        for name, value in weights.items():
            draft.params[name].copy_(value)
    return draft.eval()

"""specdec's own draft models: the file format, loading, and the trainable module.

A draft directory holds ``draft.json`` (architecture, target, recipe card) and
``weights.safetensors`` (matrices as per-row int8 with fp16 scales, vectors fp16). Drafts made
by ``specdec distill`` read their input embedding from the target's weights
(``embed_from_target``), so the file stores only what is not the target's: a few transformer
layers, a norm, and a head over a *reduced vocabulary* (the target's most frequent output
tokens, ``vocab_map``). The draft's q is zero outside that vocabulary,
which keeps speculative sampling exact: q is what the draft samples from.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.config import DEFAULT_NUMERICS
from specdec.serving.arch import ArchConfig, rope_inv_freq
from specdec.serving.engine import LlamaEngine
from specdec.serving.kernels import GROUP, GroupedCodes

FORMAT = "specdec-draft/1"
META_FILE = "draft.json"
WEIGHTS_FILE = "weights.safetensors"
SHIPPED_DIR = pathlib.Path(__file__).parents[1] / "assets" / "default_draft"
FEATURE = "feature"  # draft.json's kind of a feature-conditioned draft (absent: a plain one)
LAYER_PARAMS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")  # a layer's weights


def is_draft_dir(spec: str) -> bool:
    path = pathlib.Path(spec).expanduser()
    return (path / META_FILE).is_file()


def is_feature_draft(spec: str) -> bool:
    """A draft directory holding a feature-conditioned draft (``specdec.models.feature_model``)."""
    return is_draft_dir(spec) and read_meta(pathlib.Path(spec).expanduser()).get("kind") == FEATURE


def shipped_draft_dir() -> pathlib.Path | None:
    """The draft shipped for the default target, if this installation has one."""
    return SHIPPED_DIR if (SHIPPED_DIR / META_FILE).is_file() else None


def read_meta(path) -> dict:
    meta = json.loads((pathlib.Path(path) / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} draft (format {meta.get('format')!r})")
    return meta


def target_embedding(target: str) -> torch.Tensor:
    """The target's input embedding [vocab, hidden] in float32, read alone from the shard of
    its safetensors checkpoint that holds it."""
    from specdec.models.checkpoint import read_tensor
    from specdec.models.hub import resolve_model_dir

    # Tied models may be saved with only one of the two names.
    return read_tensor(resolve_model_dir(target),
                       ("model.embed_tokens.weight", "lm_head.weight")).float()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~= q * scale[:, None]."""
    scale = (w.abs().amax(dim=1).clamp_min(1e-8) / 127.0).float()
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


def _dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith(".int8"):
            base = name[: -len(".int8")]
            out[base] = t.float() * tensors[base + ".scale"].float()[:, None]
        elif not name.endswith(".scale"):
            out[name] = t
    return out


def stored_codes(tensors: dict[str, torch.Tensor]) -> dict[str, GroupedCodes]:
    """The stored int8 matrices as grouped codes (d: the row's scale in every group, m: 0).

    A row's scale is an fp16 and a code at most 8 bits, so d * q is exact in float32: smallm
    streams the codes (a quarter of the float32 bytes) for bit for bit the weights
    ``_dequantize`` makes. A matrix whose input width is not a multiple of GROUP is left out
    (it streams its float32)."""
    codes = {}
    for name, q in tensors.items():
        if not name.endswith(".int8") or q.shape[1] % GROUP:
            continue
        base = name[: -len(".int8")]
        d = tensors[base + ".scale"].float()[:, None].expand(-1, q.shape[1] // GROUP)
        codes[base] = GroupedCodes(q.contiguous(), d.contiguous(), torch.zeros_like(d))
    return codes


def load_stored(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, the tensors as stored: int8 matrices with their scales)."""
    from safetensors.torch import load_file

    return read_meta(path), load_file(str(pathlib.Path(path) / WEIGHTS_FILE))


def _weights(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights = _dequantize(tensors)
    if meta.get("embed_from_target"):
        weights["embed"] = target_embedding(meta["target"])
    return weights


def load_weights(path, stored: tuple[dict, dict[str, torch.Tensor]] | None = None,
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, float32-exact weights by canonical name); ``stored``: ``load_stored(path)``
    where the caller has read it already."""
    meta, tensors = stored or load_stored(path)
    return meta, _weights(meta, tensors)


def load_engine(path, device, kernels: str = "auto", quantize: str | None = None,
                numerics: str = DEFAULT_NUMERICS, dtype: torch.dtype | None = None):
    """(engine, tokenizer, None) for a draft directory. On CPU the engine also streams the
    stored int8 matrices as they are (``stored_codes``)."""
    from specdec.models.hub import load_tokenizer

    meta, tensors = load_stored(path)
    if meta.get("kind") == FEATURE:
        raise ValueError(f"{path}: a feature-conditioned draft, served as a draft only "
                         "(specdec.serving.feature_engine), not a model engine")
    weights = _weights(meta, tensors)
    arch = ArchConfig(**meta["arch"])
    vocab_map = weights.pop("vocab_map").long()
    weights = {k: v.float() for k, v in weights.items()}
    codes = stored_codes(tensors) if torch.device(device).type == "cpu" and \
        dtype in (None, torch.float32) else None
    engine = LlamaEngine(arch, weights, device, kernels, vocab_map=vocab_map, quantize=quantize,
                         codes=codes, numerics=numerics, dtype=dtype)
    return engine, load_tokenizer(meta["target"]), None


def save(path, arch: ArchConfig, weights: dict[str, torch.Tensor], vocab_map: torch.Tensor,
         target: str, card: dict, int8: bool = True, meta_extra: dict | None = None) -> None:
    """Write a draft directory, input embedding left to the target.

    Matrices are stored as per-row int8 with fp16 scales (``int8``, half the size of fp16;
    the draft *is* what is stored, so exactness is unaffected), vectors as fp16.
    ``meta_extra``: more of draft.json (a feature draft's ``kind``).
    """
    from safetensors.torch import save_file

    from specdec.models.hub import load_tokenizer
    from specdec.models.tokenizer import fingerprint

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in weights.items():
        if k == "embed":
            continue
        if int8 and v.dim() == 2:
            tensors[k + ".int8"], tensors[k + ".scale"] = quantize_int8(v.detach())
        else:
            tensors[k] = v.detach().to(torch.float16).contiguous()
    tensors["vocab_map"] = vocab_map.to(torch.int32).contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE))
    meta = dict(
        format=FORMAT,
        target=target,
        target_fingerprint=fingerprint(load_tokenizer(target)),
        arch=dataclasses.asdict(arch),
        vocab_out=int(vocab_map.shape[0]),
        embed_from_target=True,
        **(meta_extra or {}),
        card=card,
    )
    (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def target_weights(target: str, model=None) -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """A target's arch and canonical weights (from ``model``, or loaded from ``target``): what
    a trainable draft starts its layers, norm and head from."""
    from specdec.models.hub import load_hf_model
    from specdec.serving.arch import canonical_weights

    if model is None:
        model, _ = load_hf_model(target)
    arch = ArchConfig.from_hf(model.config)
    return arch, canonical_weights(model.state_dict(), arch)


class DraftModule(nn.Module):
    """The draft as a trainable module (full causal attention over whole sequences).

    Same math and canonical weight names as the engine: the engine runs what this trains.
    The input embedding is the target's, frozen.
    """

    def __init__(self, arch: ArchConfig, embed: torch.Tensor, vocab_map: torch.Tensor):
        super().__init__()
        beyond = [f for f in arch.features() if f != "rope_scaling"]
        if beyond:  # this module trains a plain Llama block (any RoPE the engine runs)
            raise ValueError(f"specdec's trainable draft is a Llama block; a {arch.model_type} "
                             f"target also has {', '.join(beyond)}, which it does not model")
        self.arch = arch
        self.register_buffer("embed", embed, persistent=False)  # frozen, the target's
        self.register_buffer("vocab_map", vocab_map.long())
        a = arch
        qkv_out = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.params = nn.ParameterDict()
        for i in range(a.num_layers):
            p = f"layers_{i}_"
            self.params[p + "attn_norm"] = nn.Parameter(torch.ones(a.hidden_size))
            self.params[p + "wqkv"] = nn.Parameter(torch.empty(qkv_out, a.hidden_size))
            self.params[p + "wo"] = nn.Parameter(torch.empty(a.hidden_size, a.num_heads * a.head_dim))
            self.params[p + "mlp_norm"] = nn.Parameter(torch.ones(a.hidden_size))
            self.params[p + "w_gate_up"] = nn.Parameter(torch.empty(2 * a.intermediate_size, a.hidden_size))
            self.params[p + "w_down"] = nn.Parameter(torch.empty(a.hidden_size, a.intermediate_size))
        self.params["norm"] = nn.Parameter(torch.ones(a.hidden_size))
        self.params["head"] = nn.Parameter(torch.empty(vocab_map.shape[0], a.hidden_size))
        for name, prm in self.params.items():
            if prm.dim() == 2:
                nn.init.normal_(prm, std=0.02)
        inv_freq = rope_inv_freq(a.rope_theta, a.rope_scaling, a.head_dim, a.max_context)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def load_canonical(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in weights.items():
                key = name.replace(".", "_")
                if key in self.params:
                    self.params[key].copy_(value)

    def canonical(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in self.params.items():
            if key.startswith("layers_"):
                _, i, rest = key.split("_", 2)
                out[f"layers.{i}.{rest}"] = value.detach()
            else:
                out[key] = value.detach()
        return out

    def _norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, seq] -> logits over the reduced vocabulary [batch, seq, vocab_out]."""
        a = self.arch
        b, t = tokens.shape
        x = self.embed[tokens]
        pos = torch.arange(t, device=tokens.device).float()
        ang = pos[:, None] * self.inv_freq[None]
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]

        def rope(v):
            v1, v2 = v.chunk(2, -1)
            return v * cos + torch.cat((-v2, v1), -1) * sin

        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        for i in range(a.num_layers):
            p = f"layers_{i}_"
            h = self._norm(x, self.params[p + "attn_norm"])
            q, k, v = F.linear(h, self.params[p + "wqkv"]).split([hq * d, hkv * d, hkv * d], -1)
            q = rope(q.view(b, t, hq, d).transpose(1, 2))
            k = rope(k.view(b, t, hkv, d).transpose(1, 2))
            v = v.view(b, t, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, hq * d), self.params[p + "wo"])
            h = self._norm(x, self.params[p + "mlp_norm"])
            gate, up = F.linear(h, self.params[p + "w_gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, self.params[p + "w_down"])
        return F.linear(self._norm(x, self.params["norm"]), self.params["head"])


def update_card(path, card: dict) -> None:
    """Replace the recipe card in a draft directory's metadata (after evaluation)."""
    meta_path = pathlib.Path(path) / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["card"] = card
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


class _FullVocabHead(nn.Module):
    """The reduced head, answering over the whole vocabulary (-1e9 outside the draft's)."""

    def __init__(self, head: torch.Tensor, vocab_map: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.head.weight.data.copy_(head)
        self.register_buffer("vocab_map", vocab_map.long())
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.head(hidden)  # [..., vocab_out]
        full = small.new_full((*small.shape[:-1], self.vocab_size), -1e9)
        return full.index_copy(-1, self.vocab_map, small)


def to_hf_model(path):
    """A transformers LlamaForCausalLM that computes exactly this draft (for HF baselines,
    e.g. ``generate(assistant_model=...)``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    meta, weights = load_weights(path)
    a = ArchConfig(**meta["arch"])
    vocab_map = weights.pop("vocab_map").long()
    embed = weights["embed"].float()
    config = LlamaConfig(
        vocab_size=embed.shape[0], hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size, num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_context, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    hq, hkv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    sd = {"model.embed_tokens.weight": embed, "model.norm.weight": weights["norm"].float()}
    for i in range(a.num_layers):
        p, w = f"model.layers.{i}.", lambda n: weights[f"layers.{i}.{n}"].float()
        q, k, v = w("wqkv").split([hq, hkv, hkv])
        gate, up = w("w_gate_up").chunk(2)
        sd.update({
            p + "input_layernorm.weight": w("attn_norm"),
            p + "post_attention_layernorm.weight": w("mlp_norm"),
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": w("wo"),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": w("w_down"),
        })
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.lm_head = _FullVocabHead(weights["head"].float(), vocab_map, embed.shape[0])
    return model.eval()

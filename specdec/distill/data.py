"""Distillation data: the target's own answers to many prompts, with its top logits.

Each prompt is answered by the target (greedy and sampled), continuously batched over the
ragged engine. For every answer token we keep the target's top-``top_n`` log-probabilities, so
the draft learns the target's distribution, not only its argmax. Output is written in shards
(``shard-NNNNN.pt``); a shard that exists is skipped, so an interrupted run resumes.

Beside each shard, its *answers* (prompt and answer token ids, temperature; no scores) are kept
in a small file (``answers-NNNNN.npz``, ~4 bytes a token) in a directory of their own. Answers
are what costs: the target writes them one token at a time. Scores (top log-probabilities,
features) are one teacher-forced pass over prompt + answer, so a new machine given only the
answers directory rebuilds every shard by scoring instead of generating. That directory is
what survives a session (the project keeps its own in git, docs/draft.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import random

import numpy as np
import torch
from tqdm import tqdm

from specdec.config import SamplingParams
from specdec.models.tokenizer import chat_prompt_ids
from specdec.serving.engine import LlamaEngine
from specdec.serving.feature_engine import half_features
from specdec.serving.sampling import position_generator, process_logits, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sequence:
    prompt: list[int]
    sampling: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)  # answer so far
    top_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each [top_n]
    top_logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    features: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each [width]
    cache: object = None


def generate_answers(
    engine: LlamaEngine,
    jobs: list[tuple[list[int], SamplingParams]],
    eos_ids: set[int],
    max_new_tokens: int,
    batch_size: int,
    top_n: int,
    progress: tqdm | None = None,
    features: bool = False,
    feature_layers: tuple[int, ...] = (),
) -> list[Sequence]:
    """Answer every (prompt ids, sampling) job with the target; continuous batching.
    ``features``: keep, for every answer token, the target's feature of the position that
    predicted it (``LlamaEngine.forward_features``; the last prompt position's for the
    first), with the residual after ``feature_layers`` before it (``feature_record``)."""
    pending = [Sequence(prompt=p, sampling=s) for p, s in jobs]
    queue = list(pending)
    active: list[Sequence] = []
    while queue or active:
        while queue and len(active) < batch_size:
            seq = queue.pop(0)
            seq.cache = engine.new_cache()
            active.append(seq)
        feed = [
            torch.tensor(s.tokens[-1:] if s.tokens else s.prompt, dtype=torch.long)
            for s in active
        ]
        logits, feats = engine.forward_features([s.cache for s in active], feed,
                                                [1] * len(active), layers=feature_layers)
        # every row's scores at once: per-row torch ops over the vocabulary cost more than the
        # forward pass's share at 96 rows (measured: ~25% of the data job)
        rows = torch.cat(logits)  # [n, vocab]
        top = rows.log_softmax(-1).topk(top_n)
        greedy = rows.argmax(-1).tolist()
        probs = {}  # sampling key -> (row positions, probabilities [m, vocab])
        for key in {_sampling_key(s.sampling) for s in active if not s.sampling.greedy}:
            at = [i for i, s in enumerate(active) if _sampling_key(s.sampling) == key]
            probs[key] = (at, process_logits(rows[at], active[at[0]].sampling))
        still = []
        for i, (seq, ft) in enumerate(zip(active, feats)):
            if features:
                seq.features.append(half_features(ft[0]))
            seq.top_ids.append(top.indices[i].to(torch.int32))
            seq.top_logprobs.append(top.values[i].to(torch.float16))
            position = len(seq.prompt) + len(seq.tokens)
            if seq.sampling.greedy:
                token = greedy[i]
            else:
                at, p = probs[_sampling_key(seq.sampling)]
                token = sample(p[at.index(i)],
                               position_generator(seq.sampling.seed, position, "target"))
            seq.tokens.append(token)
            if progress is not None:
                progress.update(1)
            if token in eos_ids or len(seq.tokens) >= max_new_tokens:
                seq.cache = None
            else:
                still.append(seq)
        active = still
    return pending


def _sampling_key(params: SamplingParams) -> tuple:
    """What process_logits reads of a request (rows that share it share one call)."""
    return (params.temperature, params.top_k, params.top_p)


def feature_record(rows: torch.Tensor, layers: tuple[int, ...], hidden: int) -> dict:
    """A record's features from ``forward_features`` rows [answer_len, (len(layers) + 1) *
    hidden]: ``features`` [answer_len, hidden] (the final feature) and, with ``layers``,
    ``taps`` [answer_len, len(layers), hidden] and ``tap_layers``; float16 as the wire's."""
    rows = half_features(rows)
    out = {"features": rows[:, rows.shape[1] - hidden:]}
    if layers:
        out["taps"] = rows[:, : len(layers) * hidden].unflatten(1, (len(layers), hidden))
        out["tap_layers"] = torch.tensor(list(layers), dtype=torch.int32)
    return out


def score_answers(engine: LlamaEngine, records: list[dict], top_n: int, features: bool,
                  batch_size: int = 8, feature_layers: tuple[int, ...] = ()) -> list[dict]:
    """Fill in each record's scores (``top_ids``, ``top_logprobs``, ``features`` if asked,
    with ``feature_record``'s taps) by one teacher-forced pass over prompt + answer: the rows
    that predicted each answer token. The same numbers generation keeps, up to float
    rounding of a different pass shape."""
    for start in range(0, len(records), batch_size):
        part = records[start : start + batch_size]
        caches = [engine.new_cache() for _ in part]
        feeds = [torch.cat([r["prompt"], r["answer"][:-1]]).long() for r in part]
        logits, feats = engine.forward_features(caches, feeds, [len(r["answer"]) for r in part],
                                                layers=feature_layers if features else ())
        for r, lg, ft in zip(part, logits, feats):
            top = lg.log_softmax(-1).topk(top_n)
            r["top_ids"] = top.indices.to(torch.int32)  # [answer_len, top_n]
            r["top_logprobs"] = top.values.to(torch.float16)
            if features:
                r.update(feature_record(ft, feature_layers, engine.arch.hidden_size))
    return records


def save_answers(records: list[dict], path: pathlib.Path) -> None:
    """The records' token ids, temperatures and conversation numbers, without scores."""
    ids = torch.cat([torch.cat([r["prompt"], r["answer"]]) for r in records])
    dtype = np.uint16 if int(ids.max()) < 2**16 else np.int32
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, ids=ids.numpy().astype(dtype),
            prompt_len=np.array([len(r["prompt"]) for r in records], np.int32),
            answer_len=np.array([len(r["answer"]) for r in records], np.int32),
            temperature=np.array([r["temperature"] for r in records], np.float32),
            conversation=np.array([r["conversation"] for r in records], np.int32))
    tmp.rename(path)


def load_answers(path: pathlib.Path) -> list[dict]:
    """``save_answers``'s records: prompt, answer, temperature, conversation."""
    z = np.load(path)
    ids = torch.from_numpy(z["ids"].astype(np.int32))
    records, at = [], 0
    for n_p, n_a, temp, conv in zip(z["prompt_len"], z["answer_len"], z["temperature"],
                                    z["conversation"]):
        records.append(dict(prompt=ids[at : at + n_p], answer=ids[at + n_p : at + n_p + n_a],
                            temperature=float(temp), conversation=int(conv)))
        at += int(n_p + n_a)
    return records


def _check_answers_dir(answers_dir: pathlib.Path, identity: dict) -> None:
    """Answers belong to one target and one job list: refuse to mix them."""
    answers_dir.mkdir(parents=True, exist_ok=True)
    meta = answers_dir / "answers.json"
    if meta.exists():
        kept = json.loads(meta.read_text())
        if kept != identity:
            raise ValueError(f"{answers_dir} holds answers made with {kept}, not {identity}: "
                             "give another --answers directory")
    else:
        meta.write_text(json.dumps(identity, indent=1) + "\n")


def write_shards(
    engine: LlamaEngine,
    tokenizer,
    conversations: list[list[dict]],
    out_dir: pathlib.Path,
    eos_ids: set[int],
    max_new_tokens: int = 192,
    batch_size: int = 32,
    top_n: int = 32,
    temperatures: tuple[float, ...] = (0.0, 0.8),
    prompts_per_shard: int = 32,
    seed: int = 0,
    features: bool = False,
    answers_dir: pathlib.Path | None = None,
    identity: dict | None = None,
    feature_layers: tuple[int, ...] = (),
) -> list[pathlib.Path]:
    """Generate answers for all conversations at every temperature; write shards (resumable).
    ``features``: each record also holds ``features`` [answer_len, hidden] (see
    ``generate_answers``), and with ``feature_layers`` ``taps`` (``feature_record``).
    ``answers_dir``: keep each shard's answers there too (``save_answers``), and where a shard
    is missing but its answers are there, score them instead of generating; ``identity``
    (target, job list) is checked against what it holds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if answers_dir is not None:
        _check_answers_dir(answers_dir, identity or {})
    rng = random.Random(seed)
    jobs = []
    for i, conv in enumerate(conversations):
        ids = chat_prompt_ids(tokenizer, conv)
        for temp in temperatures:
            params = SamplingParams(temperature=temp, seed=rng.randrange(2**32))
            jobs.append((ids, params, i))
    shards = []
    chunk = prompts_per_shard * len(temperatures)
    total_tokens_est = len(jobs) * max_new_tokens
    with tqdm(total=total_tokens_est, unit="tok", desc="target answers", smoothing=0.05) as bar:
        for start in range(0, len(jobs), chunk):
            number = start // chunk
            path = out_dir / f"shard-{number:05d}.pt"
            kept = answers_dir / f"answers-{number:05d}.npz" if answers_dir else None
            shards.append(path)
            if path.exists():
                if kept is not None and not kept.exists():
                    save_answers(torch.load(path, weights_only=True), kept)
                bar.update(chunk * max_new_tokens)
                continue
            part = jobs[start : start + chunk]
            if kept is not None and kept.exists():
                bar.set_description("scoring kept answers")
                records = score_answers(engine, load_answers(kept), top_n, features,
                                        feature_layers=feature_layers)
                bar.update(chunk * max_new_tokens)
            else:
                bar.set_description("target answers")
                seqs = generate_answers(engine, [(p, s) for p, s, _ in part], eos_ids,
                                        max_new_tokens, batch_size, top_n, progress=bar,
                                        features=features, feature_layers=feature_layers)
                bar.update(sum(max_new_tokens - len(s.tokens) for s in seqs))
                records = [
                    dict(
                        prompt=torch.tensor(s.prompt, dtype=torch.int32),
                        answer=torch.tensor(s.tokens, dtype=torch.int32),
                        top_ids=torch.stack(s.top_ids),  # [answer_len, top_n]
                        top_logprobs=torch.stack(s.top_logprobs),
                        temperature=s.sampling.temperature,
                        conversation=idx,
                        **(feature_record(torch.stack(s.features), feature_layers,
                                          engine.arch.hidden_size) if features else {}),
                    )
                    for s, (_, _, idx) in zip(seqs, part)
                ]
                if kept is not None:
                    save_answers(records, kept)
            tmp = path.with_suffix(".tmp")
            torch.save(records, tmp)
            tmp.rename(path)
    return shards


def answers_as_labels(records: list[dict]) -> list[dict]:
    """Kept answers as training records without scores: each answer token is its own label
    (``top_ids`` one column, log-prob 0). For a greedy answer that is the target's argmax
    exactly; for a sampled one, a draw from the target's distribution, so the cross-entropy
    to it is an unbiased estimate of the cross-entropy to that distribution (noisier than
    the top-32 scores, and free: no target pass)."""
    return [dict(r, top_ids=r["answer"][:, None].to(torch.int32),
                 top_logprobs=torch.zeros(len(r["answer"]), 1, dtype=torch.float16))
            for r in records]


def unscored_answers(answers_dir: pathlib.Path, data_dir: pathlib.Path) -> list[pathlib.Path]:
    """The kept answers whose shard (with scores) is not built in ``data_dir``."""
    return [p for p in sorted(answers_dir.glob("answers-*.npz"))
            if not (data_dir / p.name.replace("answers-", "shard-").replace(".npz", ".pt")).exists()]


def load_shards(paths) -> list[dict]:
    records = []
    for path in paths:
        records.extend(torch.load(path, weights_only=True))
    return records

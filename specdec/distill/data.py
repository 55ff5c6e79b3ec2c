"""Distillation data: the target's own answers to many prompts, with its top logits.

Each prompt is answered by the target (greedy and sampled), continuously batched over the
ragged engine. For every answer token we keep the target's top-``top_n`` log-probabilities, so
the draft learns the target's distribution, not only its argmax. Output is written in shards
(``shard-NNNNN.pt``); a shard that exists is skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import random

import torch
from tqdm import tqdm

from specdec.config import SamplingParams
from specdec.models.tokenizer import chat_prompt_ids
from specdec.serving.engine import LlamaEngine
from specdec.serving.sampling import position_generator, process_logits, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sequence:
    prompt: list[int]
    sampling: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)  # answer so far
    top_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each [top_n]
    top_logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    features: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each [hidden] fp16
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
) -> list[Sequence]:
    """Answer every (prompt ids, sampling) job with the target; continuous batching.
    ``features``: keep, for every answer token, the target's feature of the position that
    predicted it (``LlamaEngine.forward_features``; the last prompt position's for the
    first), in float16."""
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
                                                [1] * len(active))
        still = []
        for seq, lg, ft in zip(active, logits, feats):
            if features:
                seq.features.append(ft[0].to(torch.float16))
            logprobs = lg[0].log_softmax(-1)
            top = logprobs.topk(top_n)
            seq.top_ids.append(top.indices.to(torch.int32))
            seq.top_logprobs.append(top.values.to(torch.float16))
            position = len(seq.prompt) + len(seq.tokens)
            if seq.sampling.greedy:
                token = int(lg[0].argmax())
            else:
                probs = process_logits(lg[0], seq.sampling)
                token = sample(probs, position_generator(seq.sampling.seed, position, "target"))
            seq.tokens.append(token)
            if progress is not None:
                progress.update(1)
            if token in eos_ids or len(seq.tokens) >= max_new_tokens:
                seq.cache = None
            else:
                still.append(seq)
        active = still
    return pending


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
) -> list[pathlib.Path]:
    """Generate answers for all conversations at every temperature; write shards (resumable).
    ``features``: each record also holds ``features`` [answer_len, hidden] (see
    ``generate_answers``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    jobs = []
    for i, conv in enumerate(conversations):
        ids = chat_prompt_ids(tokenizer, conv)
        for temp in temperatures:
            params = SamplingParams(temperature=temp, seed=rng.randrange(2**32))
            jobs.append((ids, params, i))
    shards = []
    chunk = prompts_per_shard * len(temperatures)
    todo = [j for j in range(0, len(jobs), chunk)]
    total_tokens_est = len(jobs) * max_new_tokens
    with tqdm(total=total_tokens_est, unit="tok", desc="target answers", smoothing=0.05) as bar:
        for start in todo:
            path = out_dir / f"shard-{start // chunk:05d}.pt"
            shards.append(path)
            if path.exists():
                bar.update(chunk * max_new_tokens)
                continue
            part = jobs[start : start + chunk]
            seqs = generate_answers(
                engine,
                [(p, s) for p, s, _ in part],
                eos_ids,
                max_new_tokens,
                batch_size,
                top_n,
                progress=bar,
                features=features,
            )
            bar.update(sum(max_new_tokens - len(s.tokens) for s in seqs))
            records = [
                dict(
                    prompt=torch.tensor(s.prompt, dtype=torch.int32),
                    answer=torch.tensor(s.tokens, dtype=torch.int32),
                    top_ids=torch.stack(s.top_ids),  # [answer_len, top_n]
                    top_logprobs=torch.stack(s.top_logprobs),
                    temperature=s.sampling.temperature,
                    conversation=idx,
                    **({"features": torch.stack(s.features)} if features else {}),
                )
                for s, (_, _, idx) in zip(seqs, part)
            ]
            tmp = path.with_suffix(".tmp")
            torch.save(records, tmp)
            tmp.rename(path)
    return shards


def load_shards(paths) -> list[dict]:
    records = []
    for path in paths:
        records.extend(torch.load(path, weights_only=True))
    return records

"""The target as transformers runs it: the reference specdec's speed is measured against."""

from __future__ import annotations

import logging
import os
import time

import torch

log = logging.getLogger(__name__)

SYSTEMS = ("hf", "hf-assisted", "hf-prompt-lookup")


class HFGenerate:
    """transformers ``generate`` greedy on a target: alone, assisted by a draft (the same one
    specdec uses), or with prompt lookup: the baselines of ``specdec bench`` and of the demo's
    side-by-side line."""

    def __init__(self, target: str, draft: str | None, threads: int,
                 cores: list[int] | None = None):
        from specdec.models import draft_model
        from specdec.models.hub import load_hf_model
        from specdec.models.loading import resolve_draft_spec, split_quantization

        self.threads = threads
        self.cores = cores  # run on these CPU cores only (a split-topology baseline)
        self.model, self.tokenizer = load_hf_model(target)
        self.assistant = None
        if draft is not None and draft != "ngram":
            quantized, spec = split_quantization(resolve_draft_spec(draft, target))
            if quantized:  # transformers' assisted generation has no int8 draft here
                log.info("hf-assisted drafts with %s unquantized (not %s:%s)", spec,
                         quantized, spec)
            if draft_model.is_draft_dir(spec):
                self.assistant = draft_model.to_hf_model(spec)
            else:
                self.assistant, _ = load_hf_model(spec)

    def run(self, system: str, prompt_ids: list[int], max_new: int) -> tuple[list[int], float]:
        if self.threads:
            torch.set_num_threads(self.threads)
        ids = torch.tensor([prompt_ids])
        kwargs = dict(max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids),
                      pad_token_id=self.tokenizer.eos_token_id)
        if system == "hf-assisted":
            if self.assistant is None:
                raise ValueError("hf-assisted needs a model draft")
            kwargs["assistant_model"] = self.assistant
        elif system == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        before = os.sched_getaffinity(0) if self.cores else None
        if self.cores:
            os.sched_setaffinity(0, self.cores)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, **kwargs)
            wall = time.perf_counter() - t0
        finally:
            if before is not None:
                os.sched_setaffinity(0, before)
        return out[0, len(prompt_ids):].tolist(), wall

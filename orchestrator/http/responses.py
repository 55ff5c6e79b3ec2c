"""Responses in OpenAI's shapes: usage, log-probabilities, and specdec's own stats field."""

from __future__ import annotations


def is_result(item) -> bool:
    return hasattr(item, "finish_reason")


def usage(results) -> dict:
    """OpenAI's usage of one response: the prompt once, every choice's tokens."""
    prompt = results[0].prompt_tokens
    n = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def specdec_stats(result) -> dict:
    """The ``specdec`` field: what speculation did for this response."""
    s = result.summary()
    out = {k: s[k] for k in ("mode", "rounds", "draft_tokens", "accepted_tokens",
                             "acceptance_rate", "mean_tokens_per_round", "k_mean", "ttft_s",
                             "wall_s", "tokens_per_s", "overlap_efficiency", "pipeline_hits",
                             "pipeline_misses", "cache_branches", "wasted_branches",
                             "guess_calls", "re_prefills", "crowded_rounds", "accepted_per_position")}
    out["num_drafts"] = result.stats.num_drafts
    return out



class LogprobShapes:
    """choices[].logprobs as OpenAI shapes them, for chat and for text completions."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, logprobs) -> dict:
        """choices[].logprobs of a chat completion (or of one streamed delta)."""
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in logprobs], "refusal": None}

    def completion_logprobs(self, logprobs, offset: int = 0, first_token: int | None = None,
                            ) -> dict:
        """choices[].logprobs of a text completion; text_offset counts from ``offset``. With
        ``first_token`` (echo: the prompt's first token, which nothing scores) that token
        comes first, with logprob None."""
        tokens = [self._token_text(t.token_id) for t in logprobs]
        token_logprobs: list = [t.logprob for t in logprobs]
        top: list = [{self._token_text(i): lp for i, lp in t.top} for t in logprobs]
        if first_token is not None:
            tokens.insert(0, self._token_text(first_token))
            token_logprobs.insert(0, None)
            top.insert(0, None)
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}


"""Connect to a draft/target pair, check that they belong together, build an Orchestrator."""

from __future__ import annotations

import asyncio
import logging

from orchestrator.generation import DECODE_ON
from orchestrator.loop import Orchestrator
from orchestrator.service_clients import DraftClient, TargetClient
from specdec.models.hub import load_tokenizer
from specdec.models.tokenizer import fingerprint

log = logging.getLogger(__name__)


class TokenizerMismatch(ValueError):
    """The draft and target (or the orchestrator's tokenizer) do not share a tokenizer."""


class FeatureMismatch(ValueError):
    """A feature-conditioned draft reads features of another width than the target's."""


def check_pair(target_info, draft_info, tokenizer_fp: str | None = None) -> None:
    """Raise TokenizerMismatch naming both models when their tokenizers differ, and
    FeatureMismatch when a feature draft cannot read the target's features."""
    if draft_info is not None and draft_info.features and \
            draft_info.feature_dim != target_info.feature_dim * (1 + len(draft_info.feature_layers)):
        layers = f" (its final feature and layers {list(draft_info.feature_layers)})" \
            if draft_info.feature_layers else ""
        raise FeatureMismatch(
            f"draft model {draft_info.model!r} reads features of width {draft_info.feature_dim}"
            f"{layers}, target model {target_info.model!r} gives "
            f"{target_info.feature_dim or 'none'} a layer: a feature draft is trained for one "
            "target")
    if draft_info is not None and draft_info.tokenizer_fingerprint != target_info.tokenizer_fingerprint:
        raise TokenizerMismatch(
            f"draft model {draft_info.model!r} and target model {target_info.model!r} have "
            f"different tokenizers (fingerprints {draft_info.tokenizer_fingerprint[:12]} vs "
            f"{target_info.tokenizer_fingerprint[:12]}): speculative decoding needs one shared "
            "vocabulary"
        )
    if tokenizer_fp is not None and tokenizer_fp != target_info.tokenizer_fingerprint:
        raise TokenizerMismatch(
            f"the orchestrator's tokenizer differs from target model {target_info.model!r}'s "
            f"(fingerprints {tokenizer_fp[:12]} vs {target_info.tokenizer_fingerprint[:12]})"
        )


async def connect(target_addr: str, draft_addr: str | None, tokenizer_spec: str = "default",
                  tls: dict | None = None, timeout_s: float = 30.0,
                  ready_timeout_s: float = 600.0, tokenizer=None,
                  target_deadline_s: float = 0.0, shared_cores: bool = False,
                  decode_on: int = DECODE_ON) -> Orchestrator:
    """Wait for both services, check the pair, and return an Orchestrator over them.

    ``target_deadline_s``: how long a generation waits for a target that is down (dead,
    restarting, reloading) to come back before it fails with UNAVAILABLE (0: at once).
    ``shared_cores``: the two services share this machine's cores (see Orchestrator).
    ``decode_on``: plain steps the target takes on by itself in a round with no block
    (0: one round trip per such token).
    """
    target = TargetClient(target_addr, tls=tls, timeout_s=timeout_s,
                          unavailable_deadline_s=target_deadline_s)
    draft = DraftClient(draft_addr, tls=tls, timeout_s=timeout_s) if draft_addr else None
    waits = [target.wait_ready(ready_timeout_s)]
    if draft is not None:
        waits.append(draft.wait_ready(ready_timeout_s))
    try:
        await asyncio.gather(*waits)
        if tokenizer is None:
            tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, load_tokenizer, tokenizer_spec)
        check_pair(target.info, draft.info if draft else None, fingerprint(tokenizer))
    except BaseException:
        await target.close()
        if draft is not None:
            await draft.close()
        raise
    return Orchestrator(target, draft, tokenizer, list(target.info.eos_token_ids),
                        int(target.info.max_context), shared_cores=shared_cores,
                        decode_on=decode_on)


async def close(orch: Orchestrator) -> None:
    await orch.target.close()
    if orch.draft is not None:
        await orch.draft.close()

"""Stop strings: the text ends before the stop string, the token ids end with the token that
completed it, and streamed deltas carry exactly the ids of the result."""

import pytest
from conftest import run

from orchestrator.generation import GenerationRequest
from orchestrator.pair import close, connect
from orchestrator.text import TextStream
from specdec.models.hub import load_tokenizer

PROMPT = [1, 520, 3300, 12, 99, 7]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_the_stop_token_count_covers_the_whole_stop_string(tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    stream = TextStream(tokenizer, ["brown fox"])
    assert stream.update(ids, final=True) == "The quick "
    n = stream.stop_token_count
    # the ids run to the token that completed the stop string, and not one further
    assert tokenizer.decode(ids[:n]).startswith("The quick brown fox")
    assert not tokenizer.decode(ids[: n - 1]).startswith("The quick brown fox")


def test_streamed_ids_add_up_to_the_result_and_stop_at_the_stop_string(tiny_services):
    from orchestrator.generation import Delta

    async def go():
        orch = await connect(tiny_services["target"].address, tiny_services["near_draft"].address)
        try:
            free = await orch.generate(GenerationRequest(PROMPT, 40, mode="target-only"))
            text = free.text
            stop = text[len(text) // 2:][:4]
            assert stop.strip(), text
            for mode in ("target-only", "spec", "pipelined"):
                deltas, result = [], None
                async for item in orch.stream(GenerationRequest(PROMPT, 40, stop=[stop],
                                                                mode=mode, k=3)):
                    if isinstance(item, Delta):
                        deltas.append(item)
                    else:
                        result = item
                assert result.text == text[: text.index(stop)], mode
                assert "".join(d.text for d in deltas) == result.text, mode
                assert [t for d in deltas for t in d.token_ids] == result.token_ids, mode
                n = len(result.token_ids)
                assert result.token_ids == free.token_ids[:n], mode
                decoded = orch.tokenizer.decode(result.token_ids, skip_special_tokens=True)
                assert stop in decoded, mode
                assert stop not in orch.tokenizer.decode(result.token_ids[:-1],
                                                         skip_special_tokens=True), mode
        finally:
            await close(orch)

    run(go())

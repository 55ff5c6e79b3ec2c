"""End of sequence as transformers does it: ids listed only in generation_config.json count."""

import json
import shutil

from conftest import ServiceThread, hf_greedy, run

from orchestrator.generation import GenerationRequest
from orchestrator.pair import close, connect
from specdec.models.hub import load_hf_model
from specdec.models.tokenizer import eos_token_ids

PROMPT = [1, 520, 3300, 12, 99, 7]


def test_an_end_of_turn_id_only_in_the_generation_config_stops_where_transformers_stops(
        tiny_models, tmp_path):
    free = hf_greedy(tiny_models["target"], PROMPT, 12)
    end_of_turn = free[3]  # the model's 4th token: declare it an end-of-turn token
    model_dir = tmp_path / "eot"
    shutil.copytree(tiny_models["target"], model_dir)
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], end_of_turn]
    gen_path.write_text(json.dumps(gen))

    model, tokenizer = load_hf_model(str(model_dir))
    assert end_of_turn not in (model.config.eos_token_id, tokenizer.eos_token_id)
    assert end_of_turn in eos_token_ids(tokenizer, model.config)

    reference = hf_greedy(str(model_dir), PROMPT, 12)
    assert reference == free[: free.index(end_of_turn) + 1]  # transformers stops on it

    target = ServiceThread("target", str(model_dir))
    draft = ServiceThread("draft", tiny_models["near_draft"], target=str(model_dir))

    async def go():
        orch = await connect(target.address, draft.address)
        try:
            assert end_of_turn in orch.target.info.eos_token_ids
            for mode in ("target-only", "spec", "pipelined"):
                result = await orch.generate(GenerationRequest(PROMPT, 12, mode=mode, k=3))
                assert result.token_ids == reference, mode
                assert result.finish_reason == "stop"
        finally:
            await close(orch)

    try:
        run(go())
    finally:
        target.stop()
        draft.stop()

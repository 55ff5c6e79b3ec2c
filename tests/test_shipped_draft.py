"""The draft shipped for the default target: loads, is small, and reaches its stated figures."""

import pathlib

import pytest

from specdec.models import draft_model

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def shipped():
    path = draft_model.shipped_draft_dir()
    assert path is not None, "the default draft is not shipped in specdec/assets/default_draft"
    return path


def test_shipped_draft_is_small_int8_and_has_no_target_weights(shipped):
    from safetensors import safe_open

    size = sum(f.stat().st_size for f in pathlib.Path(shipped).iterdir())
    assert size < 16 * 1024 * 1024
    with safe_open(str(pathlib.Path(shipped) / draft_model.WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
        assert not any(n.startswith("embed") for n in names)  # the target's, not stored twice
        for n in names:
            dtype = f.get_tensor(n).dtype
            if n.endswith(".int8"):
                assert str(dtype) == "torch.int8" and n[:-5] + ".scale" in names
            elif n != "vocab_map":
                assert str(dtype) == "torch.float16", n


def test_shipped_draft_reaches_its_stated_acceptance(shipped, tmp_path):
    """Teacher-forced greedy acceptance on a small fixed held-out set, against the card."""
    from specdec.distill import train as distill
    from specdec.distill.cli import held_out_records

    meta = draft_model.read_meta(shipped)
    stated = meta["card"]["held_out"]["greedy_acceptance"]
    held = held_out_records(meta["target"], tmp_path, n_prompts=8, max_new=64)
    figures = distill.evaluate(str(shipped), held)
    # 8 prompts x 64 tokens: allow sampling noise of a few points around the 48-prompt figure
    assert figures["greedy_acceptance"] >= stated - 0.08, (figures, stated)
    assert figures["tokens_per_round"]["4"] > 1.0 + figures["greedy_acceptance"] * 0.9

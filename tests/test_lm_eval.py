"""lm-evaluation-harness as a real client: its `local-completions` model against specdec's
HTTP API scores a generate-until task and a log-likelihood (multiple-choice) task exactly as
its `hf` model does on the same target, sample by sample.

The tasks are defined over JSON-lines files this test writes (no dataset hub). The tiny
target is random-weight, so its text is gibberish; the generate-until task's answers are made
from transformers' own greedy continuations (half right, half wrong), so exact_match is
neither 0 nor 1, and one choice of every multiple-choice question is the target's own greedy
continuation, so is_greedy is sometimes true.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import MODEL, ApiHost, hf_greedy, scrape

GEN_STOP = ["\n", "ing"]  # `until` of the generate-until task (lm-eval adds the EOS string)
MAX_GEN_TOKS = 12
LIMIT = 8  # lm-eval's --limit: the first 8 documents of each task (10 are written)
SCORES = [("specdec_gen", "exact_match,none"), ("specdec_mc", "acc,none"),
          ("specdec_mc", "acc_norm,none")]
LOGPROB_TOL = 1e-3  # specdec's logprobs vs transformers': rounding of different pass shapes

GEN_PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "Q: 2 + 2 =",
    "The color of the sky is",
    "Once upon a time",
    "Translate to French: cat ->",
    "List three fruits:",
    "def add(a, b):\n    return",
    "The quick brown fox",
    "Rain falls because",
    "My favourite number is",
]
MC_QUESTIONS = [
    ("The opposite of hot is", ["cold", "warm", "blue", "a very long answer indeed"]),
    ("Two plus two equals", ["four", "five", "twenty-two", "fish"]),
    ("The sun rises in the", ["east", "west", "north", "kitchen"]),
    ("Paris is the capital of", ["France", "Spain", "Mars", "the world"]),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin", "below"]),
    ("A cat says", ["meow", "woof", "moo", "nothing at all"]),
    ("The first letter of the alphabet is", ["A", "B", "Z", "Omega"]),
    ("Bees make", ["honey", "milk", "bread", "cars"]),
    ("Ice is", ["frozen water", "hot", "a planet", "green"]),
    ("Seven days make a", ["week", "month", "year", "day"]),
]


def greedy_text(tok, model_dir: str, prompt: str, n: int) -> str:
    """transformers' greedy continuation as lm-eval's `hf` model reports it: decoded without
    special tokens, cut at the first stop string."""
    ids = hf_greedy(model_dir, tok(prompt, add_special_tokens=False)["input_ids"], n)
    text = tok.decode(ids, skip_special_tokens=True)
    for stop in GEN_STOP:
        text = text.split(stop)[0]
    return text


def write_tasks(root, tok, model_dir: str) -> None:
    """Two task YAMLs (JSON is YAML) over local JSON-lines files, in ``root``."""
    gen_docs, mc_docs = [], []
    for i, prompt in enumerate(GEN_PROMPTS):
        right = greedy_text(tok, model_dir, prompt, MAX_GEN_TOKS)
        gen_docs.append({"prompt": prompt, "answer": right if i % 2 == 0 else "Paris"})
    for i, (question, choices) in enumerate(MC_QUESTIONS):
        # one choice is the target's own first greedy tokens (is_greedy can be true)
        ids = hf_greedy(model_dir, tok(question, add_special_tokens=False)["input_ids"], 2)
        own = tok.decode(ids, skip_special_tokens=True).strip() or "x"
        choices = choices[:3] + [own]
        mc_docs.append({"question": question, "choices": choices, "label": i % 4})
    for name, docs in (("gen", gen_docs), ("mc", mc_docs)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = {"dataset_path": "json", "test_split": "test"}

    def data(name: str) -> dict:
        return {"data_files": {"test": str(root / f"{name}.jsonl")},
                "cache_dir": str(root / "datasets-cache")}

    tasks = {
        "specdec_gen": {
            **common, "dataset_kwargs": data("gen"), "output_type": "generate_until",
            "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": GEN_STOP, "max_gen_toks": MAX_GEN_TOKS,
                                  "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                             "higher_is_better": True}],
        },
        "specdec_mc": {
            **common, "dataset_kwargs": data("mc"), "output_type": "multiple_choice",
            "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean",
                             "higher_is_better": True}],
        },
    }
    for name, config in tasks.items():
        (root / f"{name}.yaml").write_text(json.dumps({"task": name, **config}, indent=1))


def evaluate(model: str, model_args: dict, task_dir) -> dict:
    """lm-eval's Python API (what its CLI runs) on both tasks, per-sample records kept."""
    from lm_eval import simple_evaluate  # imported here: a heavy import for other modules
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model, model_args=model_args, tasks=["specdec_gen", "specdec_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        limit=LIMIT, batch_size=1, log_samples=True, bootstrap_iters=0,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


@pytest.fixture(scope="module")
def api(tiny_services):
    """specdec's HTTP API over the tiny target and a draft that agrees often, not always:
    pipelined rounds of k = 3 (fixed: adaptive k may find that a draft as large as the target
    does not pay and verify no drafts), with accepts and rejections."""
    from orchestrator.http.schemas import ServeDefaults

    host = ApiHost(tiny_services["target"].address, tiny_services["near_draft"].address)
    yield host.serve(defaults=ServeDefaults(k=3))
    host.stop()


def test_lm_eval_local_completions_scores_as_hf(api, tiny_models, tmp_path):
    from transformers import AutoTokenizer

    target = tiny_models["target"]
    tok = AutoTokenizer.from_pretrained(target)
    write_tasks(tmp_path, tok, target)

    before = scrape(api)
    t0 = time.monotonic()
    ours = evaluate("local-completions", {
        "model": MODEL, "base_url": f"{api}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": target, "num_concurrent": 1, "max_retries": 1, "timeout": 120}, tmp_path)
    t1 = time.monotonic()
    after = scrape(api)
    ref = evaluate("hf", {"pretrained": target, "device": "cpu", "dtype": "float32"}, tmp_path)
    print(f"lm-eval: local-completions {t1 - t0:.1f} s, hf {time.monotonic() - t1:.1f} s")
    for task, m in SCORES:
        print(task, m, "specdec", ours["results"][task][m], "hf", ref["results"][task][m])

    # generate-until: the same text for every document
    gen_ours = sorted(ours["samples"]["specdec_gen"], key=lambda s: s["doc_id"])
    gen_ref = sorted(ref["samples"]["specdec_gen"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in gen_ours] == [s["doc_id"] for s in gen_ref] == \
        list(range(LIMIT))
    texts = [s["resps"][0][0] for s in gen_ref]
    assert [s["resps"][0][0] for s in gen_ours] == texts
    assert len(set(texts)) == LIMIT and all(texts), texts
    # some generations ended at a stop string, some at max_gen_toks
    n_tokens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert min(n_tokens) < MAX_GEN_TOKS - 2 and max(n_tokens) >= MAX_GEN_TOKS - 1, n_tokens

    # log-likelihood: every choice's log-likelihood within LOGPROB_TOL, is_greedy equal
    mc_ours = sorted(ours["samples"]["specdec_mc"], key=lambda s: s["doc_id"])
    mc_ref = sorted(ref["samples"]["specdec_mc"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in mc_ours] == [s["doc_id"] for s in mc_ref] == \
        list(range(LIMIT))
    worst, greedy_flags, picks = 0.0, [], []
    for a, b in zip(mc_ours, mc_ref):
        assert a["arguments"] == b["arguments"]  # the same (context, continuation) pairs
        lls_a = [float(r[0][0]) for r in a["resps"]]
        lls_b = [float(r[0][0]) for r in b["resps"]]
        assert len(lls_a) == len(lls_b) == 4
        for x, y in zip(lls_a, lls_b):
            worst = max(worst, abs(x - y))
            assert abs(x - y) < LOGPROB_TOL, (a["doc_id"], lls_a, lls_b)
        flags = [bool(r[0][1]) for r in a["resps"]]
        assert flags == [bool(r[0][1]) for r in b["resps"]], a["doc_id"]
        assert len(set(lls_b)) == 4  # the choices score differently
        greedy_flags += flags
        picks.append(max(range(4), key=lls_b.__getitem__))
    print(f"max |loglikelihood difference| {worst:.2e}; is_greedy true for "
          f"{sum(greedy_flags)} of {len(greedy_flags)} choices; argmax choices {picks}")
    assert any(greedy_flags) and not all(greedy_flags)
    assert len(set(picks)) > 1  # the model does not always prefer the same position

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    # every lm-eval request was served (one per generation, one per choice), none refused,
    # and the generations were speculated: drafts verified, some accepted, some rejected
    served = sum(moved("specdec:request_success_total", finished_reason=r)
                 for r in ("stop", "length"))
    assert served == LIMIT + 4 * LIMIT
    assert moved("specdec:request_failure_total", reason="invalid") == 0
    drafted = moved("specdec:spec_decode_num_draft_tokens_total")
    accepted = moved("specdec:spec_decode_num_accepted_tokens_total")
    print(f"specdec: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
    assert 0 < accepted < drafted, (accepted, drafted)

    # the scores
    for task, m in SCORES:
        assert ours["results"][task][m] == ref["results"][task][m], (task, m)
    exact = ref["results"]["specdec_gen"]["exact_match,none"]
    assert 0 < exact < 1, exact  # half the answers are the target's own continuation

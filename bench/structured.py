"""Structured output under speculation: acceptance and tokens/s of JSON-schema-constrained
requests against the same prompts unconstrained, per mode, and the grammar's cost per token.

Starts the default pair as local services (as ``specdec serve`` does), then for each schema
(a prompt asking for that JSON) and mode (target-only / spec / pipelined) runs one greedy
generation constrained by the schema's grammar, one without it, and one constrained and
sampled (temperature 0.8, seed = the schema's number). Reports per mode and kind: acceptance (accepted / drafted tokens), tokens per round, tokens/s, and for the
constrained runs the share of outputs that parse and validate. The grammar's cost per token is
timed on the constrained outputs: one mask (``GrammarState.allowed``) and one ``accept`` per
token, as a service pays per block row, against the target's calibrated one-token step.

    python -m bench.structured [--schemas 24] [--max-new 48] [--modes target-only spec pipelined]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from tqdm import tqdm


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


# Every field bounded (JSON Schema's maxLength, minimum/maximum, maxItems): the 135M default
# target, greedy, can repeat within an unbounded field until max_tokens ends it
# (docs/structured-output.md); bounds make every output end, so every one can validate.
S, B = {"type": "string", "maxLength": 40}, {"type": "boolean"}
I = {"type": "integer", "minimum": 0, "maximum": 100000}
N = {"type": "number", "minimum": -1000, "maximum": 100000}


def _list(item: dict) -> dict:
    return {"type": "array", "items": item, "maxItems": 4}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


# (what to ask for, its schema): 24 everyday extraction / generation shapes
SCHEMAS = [
    ("a city: its name, country and population in millions", _obj(
        {"name": S, "country": S, "population_millions": N})),
    ("a person: first name, last name, age and hobbies", _obj(
        {"first_name": S, "last_name": S, "age": _int(0, 120), "hobbies": _list(S)})),
    ("a book: title, author, year and genre", _obj(
        {"title": S, "author": S, "year": _int(1000, 2030), "genre": S})),
    ("a recipe: name, ingredients and number of steps", _obj(
        {"name": S, "ingredients": _list(S), "steps": _int(1, 50)})),
    ("the weather: city, temperature in celsius and whether it rains", _obj(
        {"city": S, "temperature_c": N, "raining": B})),
    ("a movie review: title, rating from 1 to 5 and a one-line summary", _obj(
        {"title": S, "rating": _int(1, 5), "summary": S})),
    ("a product: name, price in dollars and whether it is in stock", _obj(
        {"name": S, "price": N, "in_stock": B})),
    ("a meeting: title, day of the week and attendees", _obj(
        {"title": S, "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday",
                                      "Friday"]}, "attendees": _list(S)})),
    ("a country: name, capital, continent and languages", _obj(
        {"name": S, "capital": S, "continent": S, "languages": _list(S)})),
    ("a math answer to 12 * 7: the expression and the result", _obj(
        {"expression": S, "result": I})),
    ("a sentiment label for 'I love this phone'", _obj(
        {"text": S, "sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    ("an address: street, city, postal code and country", _obj(
        {"street": S, "city": S, "postal_code": S, "country": S})),
    ("a to-do item: task, priority and done flag", _obj(
        {"task": S, "priority": {"enum": ["low", "medium", "high"]}, "done": B})),
    ("an animal: name, class, number of legs and whether it can fly", _obj(
        {"name": S, "class": S, "legs": _int(0, 1000), "can_fly": B})),
    ("a planet: name, order from the sun and number of moons", _obj(
        {"name": S, "order": _int(1, 9), "moons": _int(0, 200)})),
    ("a song: title, artist and length in seconds", _obj(
        {"title": S, "artist": S, "seconds": _int(1, 3600)})),
    ("a flight: from, to, airline and duration in hours", _obj(
        {"from": S, "to": S, "airline": S, "hours": N})),
    ("a student: name, grade and three course names", _obj(
        {"name": S, "grade": _int(1, 12), "courses": _list(S)})),
    ("a color: name, hex code and whether it is warm", _obj(
        {"name": S, "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}, "warm": B})),
    ("a company: name, founded year, employees and industry", _obj(
        {"name": S, "founded": _int(1600, 2030), "employees": I, "industry": S})),
    ("a tweet: author, text and like count", _obj({"author": S, "text": S, "likes": I})),
    ("an event: name, date as YYYY-MM-DD and location", _obj(
        {"name": S, "date": {"type": "string", "format": "date"}, "location": S})),
    ("a car: make, model, year and electric flag", _obj(
        {"make": S, "model": S, "year": _int(1900, 2030), "electric": B})),
    ("a quiz question with four options and the index of the answer", _obj(
        {"question": S, "options": _list(S), "answer": _int(0, 3)})),
]


def prompt_of(what: str) -> str:
    return f"Reply with JSON describing {what}."


# kind -> (constrained, temperature): sampled runs use a fixed seed per schema, so under the
# coupled rule every mode must write the same tokens
KINDS = {"unconstrained": (False, 0.0), "constrained": (True, 0.0),
         "constrained T=0.8": (True, 0.8)}


async def _run(orch, prompt_ids: list[int], max_new: int, mode: str, grammar: str,
               temperature: float = 0.0, seed: int = 0):
    from orchestrator.generation import GenerationRequest
    from specdec.config import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=seed, grammar=grammar,
                              prompt_len=len(prompt_ids))
    return await orch.generate(GenerationRequest(prompt_ids, max_new, sampling, [], mode, None))


def _summary(results: list, wall_s: float) -> dict:
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    rounds = sum(r.stats.rounds for r in results)
    return dict(tokens=tokens, tokens_per_s=tokens / wall_s if wall_s else 0.0,
                acceptance=accepted / drafted if drafted else None,
                tokens_per_round=tokens / rounds if rounds else None)


def grammar_cost_ms(grammars, grammar: str, prompt_len: int, prompt_ids: list[int],
                    tokens: list[int]) -> list[float]:
    """ms per token of one mask and one accept along ``tokens`` (a constrained output)."""
    state = grammars.state(grammar, prompt_len)
    state.sync(prompt_ids)
    out = []
    for tok in tokens:
        start = time.perf_counter()
        state.allowed()
        ok = state.accept(tok)
        out.append((time.perf_counter() - start) * 1000.0)
        if not ok:
            break
    return out


async def _measure(orch, tokenizer, cases, modes, max_new: int) -> dict:
    import jsonschema
    import xgrammar as xgr

    from specdec.models.tokenizer import encode_prompt

    grammars = [str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
                for _, schema in cases]
    prompts = [encode_prompt(tokenizer, prompt_of(what), True) for what, _ in cases]
    rows, valid, costs, outputs = {}, {}, [], {}
    with tqdm(total=len(cases) * len(modes) * len(KINDS), desc="structured", unit="gen") as bar:
        for mode in modes:
            for kind, (constrained, temperature) in KINDS.items():
                results, wall = [], 0.0
                for n, ((what, schema), grammar, ids) in enumerate(zip(cases, grammars, prompts)):
                    started = time.perf_counter()
                    r = await _run(orch, ids, max_new, mode, grammar if constrained else "",
                                   temperature, seed=n)
                    wall += time.perf_counter() - started
                    results.append(r)
                    bar.update(1)
                    if constrained:
                        outputs.setdefault((what, kind), set()).add(tuple(r.token_ids))
                        ok = False
                        if r.finish_reason == "stop":
                            try:
                                jsonschema.validate(json.loads(r.text), schema)
                                ok = True
                            except (ValueError, jsonschema.ValidationError):
                                pass
                        valid.setdefault(f"{mode} {kind}", []).append(ok)
                        if mode == modes[0] and kind == "constrained":
                            costs += grammar_cost_ms(orch.grammars, grammar, len(ids), ids,
                                                     r.token_ids)
                rows[(mode, kind)] = _summary(results, wall)
    step_ms = float(orch.target.info.forward_ms[0]) if orch.target.info.forward_ms else None
    return dict(
        rows=[dict(mode=m, kind=k, **v) for (m, k), v in rows.items()],
        valid={m: f"{sum(v)}/{len(v)}" for m, v in valid.items()},
        identical_across_modes=all(len(v) == 1 for v in outputs.values()),
        grammar_ms_per_token=dict(median=statistics.median(costs), mean=statistics.fmean(costs),
                                  p90=sorted(costs)[int(0.9 * (len(costs) - 1))]),
        target_step_ms=step_ms)


def _print(report: dict) -> None:
    print(f"{'mode':<12} {'kind':<18} {'acceptance':>10} {'tok/round':>9} {'tok/s':>7}")
    for r in report["rows"]:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        print(f"{r['mode']:<12} {r['kind']:<18} {acc:>10} {tpr:>9} {r['tokens_per_s']:>7.1f}")
    g = report["grammar_ms_per_token"]
    print(f"valid constrained outputs: {report['valid']}; identical across modes: "
          f"{report['identical_across_modes']}")
    print(f"grammar per token: median {g['median']:.3f} ms, mean {g['mean']:.3f} ms, p90 "
          f"{g['p90']:.3f} ms; target step {report['target_step_ms']} ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemas", type=int, default=len(SCHEMAS),
                   help=f"how many of the {len(SCHEMAS)} schemas to run")
    p.add_argument("--max-new", type=int, default=48, help="tokens per generation at most")
    p.add_argument("--modes", nargs="+", default=["target-only", "spec", "pipelined"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", help="write the report here as JSON")
    args = p.parse_args(argv)

    from orchestrator.local import LocalServices
    from orchestrator.pair import close, connect

    loop = asyncio.new_event_loop()
    with LocalServices(threads=args.threads) as services:
        orch = loop.run_until_complete(connect(  # as specdec serve runs its local pair
            services.target_addr, services.draft_addr, shared_cores=True))
        try:
            report = loop.run_until_complete(_measure(
                orch, orch.tokenizer, SCHEMAS[: args.schemas], args.modes, args.max_new))
        finally:
            loop.run_until_complete(close(orch))
    loop.close()
    report.update(schemas=args.schemas, max_new=args.max_new, threads=args.threads)
    _print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

"""``specdec distill`` and ``specdec eval-draft`` (command-line front of specdec.distill.train)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import time

log = logging.getLogger(__name__)


def register(sub) -> None:
    d = sub.add_parser("distill", help="build a draft model for a target by distillation")
    d.add_argument("--target", default="default")
    d.add_argument("--out", default="runs/distill", help="work directory (resumable)")
    d.add_argument("--prompts", type=int, default=3200, help="training prompts (shipped set)")
    d.add_argument("--prompt-set", default="base", choices=("base", "wide", "real", "self"),
                   help="training prompts: the base templates, the wide ones, half of them "
                        "made from real text (specdec.distill.prompts.train_conversations), or "
                        "user turns the target writes itself (specdec.distill.selfprompts, "
                        "kept in the answers directory's prompts.jsonl)")
    d.add_argument("--max-new-tokens", type=int, default=192, help="per target answer")
    d.add_argument("--temperatures", default="0,0.8",
                   help="one answer per prompt at each temperature (0 = greedy)")
    d.add_argument("--gen-batch", type=int, default=96, help="answers generated at once")
    d.add_argument("--text-files", nargs="*", default=[],
                   help="plain text files to add, scored by the target (teacher forcing)")
    d.add_argument("--heldout-prompts", type=int, default=48)
    d.add_argument("--skip-data", action="store_true",
                   help="train on the shards already generated, generate no more")
    d.add_argument("--features", action="store_true",
                   help="keep the target's feature of every answer position with the data "
                        "(for a feature-conditioned draft)")
    d.add_argument("--feature-layers", default="",
                   help="with --features: also the residual stream after these target layers "
                        "(comma-separated, e.g. 2,14: a draft trained with --feature-layers)")
    d.add_argument("--answers", help="where each shard's answers (token ids only, ~4 bytes a "
                        "token) are kept; shards missing there are rebuilt from them by scoring "
                        "instead of generating (default: OUT/answers)")
    d.add_argument("--answers-as-labels", action="store_true",
                   help="with --skip-data: also train on the kept answers whose shards are not "
                        "built, each answer token its own label (no scoring pass)")
    d.add_argument("--more-answers", nargs="+", default=[], metavar="DIR",
                   help="with --answers-as-labels: more answers directories (another prompt "
                        "set's) to train on, every answer labelled by its own tokens")
    d.add_argument("--data-only", action="store_true",
                   help="generate (or finish generating) the shards, then stop")
    d.add_argument("--vocab", type=int, default=8192, help="draft head vocabulary size")
    d.add_argument("--layers", default="0,29", help="target layers to initialise from")
    d.add_argument("--init-draft", metavar="DRAFT",
                   help="train on from this specdec draft (e.g. default-draft) instead of "
                        "from target layers: its weights, layers and head vocabulary")
    d.add_argument("--grow", metavar="LAYERS",
                   help="with --init-draft: insert new layers, started from these target layers "
                        "(e.g. 15), before the draft's last one, their output projections zero, "
                        "so the deeper draft starts computing exactly what the draft did")
    d.add_argument("--steps", type=int, default=600)
    d.add_argument("--batch", type=int, default=16)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--max-len", type=int, default=384)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    d.add_argument("--draft-out", help="where to write the draft (default: OUT/draft)")
    d.set_defaults(func=cmd_distill)

    e = sub.add_parser("eval-draft", help="held-out evaluation of a draft for its target")
    e.add_argument("--draft", default="default-draft")
    e.add_argument("--heldout-prompts", type=int, default=48)
    e.add_argument("--held-out", default="templated,handwritten",
                   help="held-out sets, comma-separated: templated (training-like prompts on "
                        "unseen topics), handwritten (unseen phrasings) (default: %(default)s)")
    e.add_argument("--max-new-tokens", type=int, default=192)
    e.add_argument("--work", default="runs/distill", help="held-out data cache directory")
    e.add_argument("--threads", type=int, default=1)
    e.set_defaults(func=cmd_eval)

    f = sub.add_parser("distill-feature", add_help=False,
                       help="the feature-conditioned (EAGLE-style) draft: held-out data, "
                            "training, evaluation, export (heldout|train|eval|export ...; "
                            "specdec distill --features makes its data)")
    f.add_argument("-h", "--help", action="store_true", help=argparse.SUPPRESS)
    f.add_argument("args", nargs=argparse.REMAINDER)
    f.set_defaults(func=lambda args: _feature_draft_main(["--help"] * args.help + args.args))


def _feature_draft_main(argv: list[str]) -> int:
    from specdec.distill import feature_draft

    feature_draft.main(argv, prog="specdec distill-feature")
    return 0


def _engine_and_tokenizer(target: str):
    import torch

    from specdec.models.loading import load_engine

    engine, tokenizer, config = load_engine(target, torch.device("cpu"))
    from specdec.models.tokenizer import eos_token_ids

    return engine, tokenizer, set(eos_token_ids(tokenizer, config))


def held_out_records(target: str, work: pathlib.Path, n_prompts: int, max_new: int,
                     engine=None, tokenizer=None, eos=None, held_out: str = "templated",
                     features: bool = False, feature_layers: tuple[int, ...] = ()
                     ) -> list[dict]:
    """The target's greedy answers to a held-out set's prompts (cached in WORK/heldout for the
    templated set, WORK/heldout-NAME for the others; with the target's ``features``, for a
    feature draft, in WORK/heldout-NAME-features, or WORK/heldout-NAME-features-2-14 with
    those ``feature_layers``)."""
    from specdec.distill.data import load_shards, write_shards
    from specdec.distill.prompts import held_out_set

    if engine is None:
        engine, tokenizer, eos = _engine_and_tokenizer(target)
    cache = work / ("heldout" if held_out == "templated" and not features else
                    f"heldout-{held_out}" + ("-features" if features else "") +
                    "".join(f"-{x}" for x in feature_layers))
    shards = write_shards(engine, tokenizer, held_out_set(held_out, n_prompts),
                          cache, eos, max_new_tokens=max_new, batch_size=48,
                          temperatures=(0.0,), prompts_per_shard=n_prompts, features=features,
                          feature_layers=feature_layers)
    return load_shards(shards)


def score_text_files(engine, tokenizer, files: list[str], out: pathlib.Path,
                     chunk: int = 256, top_n: int = 32) -> list[pathlib.Path]:
    """Teacher-forced target top-N log-probs over plain text, as distillation records."""
    import torch
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, f in enumerate(files):
        path = out / f"text-{i:05d}.pt"
        paths.append(path)
        if path.exists():
            continue
        ids = tokenizer(pathlib.Path(f).read_text(errors="replace"))["input_ids"]
        records = []
        for s in tqdm(range(0, max(len(ids) - 1, 1), chunk), desc=f"scoring {f}", unit="chunk"):
            seq = ids[s : s + chunk + 1]
            if len(seq) < 2:
                continue
            cache = engine.new_cache()
            logits = engine.forward([cache], [torch.tensor(seq[:-1])], [len(seq) - 1])[0]
            top = logits.log_softmax(-1).topk(top_n)
            records.append(dict(prompt=torch.tensor(seq[:1], dtype=torch.int32),
                                answer=torch.tensor(seq[1:], dtype=torch.int32),
                                top_ids=top.indices.to(torch.int32),
                                top_logprobs=top.values.to(torch.float16),
                                temperature=-1.0, conversation=-1))
        torch.save(records, path)
    return paths


def cmd_distill(args) -> int:
    import torch

    from specdec.distill import train as distill
    from specdec.distill.data import write_shards
    from specdec.distill.prompts import train_conversations
    from specdec.models import draft_model

    for flag, needs in (("answers_as_labels", "skip_data"), ("more_answers", "answers_as_labels"),
                        ("grow", "init_draft")):  # before any work
        if getattr(args, flag) and not getattr(args, needs):
            raise SystemExit(f"error: --{flag.replace('_', '-')} goes with "
                             f"--{needs.replace('_', '-')}")
    if args.threads:
        torch.set_num_threads(args.threads)
    work = pathlib.Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    engine, tokenizer, eos = _engine_and_tokenizer(args.target)
    temps = tuple(float(t) for t in args.temperatures.split(","))
    answers_dir = pathlib.Path(args.answers or work / "answers")
    if args.skip_data:
        shards = sorted((work / "data").glob("shard-*.pt"))
    else:
        if args.prompt_set == "self":
            convs = _self_conversations(engine, tokenizer, eos, args.prompts,
                                        answers_dir / "prompts.jsonl", args.seed)
        else:
            convs = train_conversations(args.prompts, prompt_set=args.prompt_set)
        from specdec.models.feature_model import parse_layers

        shards = write_shards(engine, tokenizer, convs,
                              work / "data", eos, max_new_tokens=args.max_new_tokens,
                              batch_size=args.gen_batch, temperatures=temps, seed=args.seed,
                              features=args.features or bool(args.feature_layers),
                              feature_layers=parse_layers(args.feature_layers),
                              answers_dir=answers_dir,
                              identity=dict(target=args.target, prompt_set=args.prompt_set,
                                            prompts=args.prompts, temperatures=list(temps),
                                            seed=args.seed,
                                            max_new_tokens=args.max_new_tokens))
    if args.data_only:
        print(f"data: {len(shards)} shards in {work / 'data'} ({time.time() - t0:.0f} s)")
        return 0
    shards += score_text_files(engine, tokenizer, args.text_files, work / "text")
    held = held_out_records(args.target, work, args.heldout_prompts, args.max_new_tokens,
                            engine, tokenizer, eos)
    data_s = time.time() - t0
    del engine
    records = _training_records(args, work, shards)
    n_tokens = sum(len(r["answer"]) for r in records)
    print(f"training data: {len(records)} answers, {n_tokens} target tokens")
    recipe = distill.Recipe(target=args.target, layers=tuple(int(x) for x in args.layers.split(",")),
                            vocab=args.vocab, max_len=args.max_len, batch=args.batch,
                            steps=args.steps, lr=args.lr, seed=args.seed)
    torch.manual_seed(args.seed)
    module, arch, vocab_map, recipe, start = _start(args, recipe, records, eos)
    vocab_size = len(tokenizer)
    examples = distill.Examples(records, vocab_map, vocab_size, recipe.max_len)
    held_ex = distill.Examples(held, vocab_map, vocab_size, recipe.max_len)
    t1 = time.time()
    # a run writing elsewhere (or training on from a draft) resumes from its own checkpoint,
    # beside the draft it writes, never from another run's
    out_dir = pathlib.Path(args.draft_out or work / "draft")
    ckpt = work / "train.ckpt" if not (args.draft_out or args.init_draft) else \
        out_dir.with_name(out_dir.name + ".ckpt")
    figures = distill.train(module, examples, recipe, ckpt, held_ex)
    train_s = time.time() - t1
    card = {
        "recipe": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in vars(recipe).items()},
        "data": {"answers": len(records), "target_tokens": n_tokens,
                 "prompts": args.prompts, "temperatures": list(temps),
                 "text_files": args.text_files,
                 "vocab_coverage_train": round(distill.coverage(records, vocab_map), 4),
                 "vocab_coverage_held_out": round(distill.coverage(held, vocab_map), 4)},
        "training": figures,
        "trained_on_from": None if start is None else {
            "draft": args.init_draft, "its_data": start["card"].get("data")},
        "time_s": {"data": round(data_s, 1), "train": round(train_s, 1)},
        "command": _command(args),
    }
    draft_model.save(out_dir, arch, module.canonical(), vocab_map, args.target, card)
    card["held_out"] = distill.evaluate(str(out_dir), held)
    draft_model.update_card(out_dir, card)
    (work / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["held_out"], indent=2))
    print(f"draft written to {out_dir}")
    return 0


def _self_conversations(engine, tokenizer, eos, n: int, path: pathlib.Path,
                        seed: int) -> list[list[dict]]:
    """n user turns the target writes itself (kept in ``path``), none a held-out prompt."""
    from specdec.distill.prompts import HELD_OUT_SETS, held_out_set
    from specdec.distill.selfprompts import self_written_prompts

    held = [m["content"] for name in HELD_OUT_SETS for conv in held_out_set(name)
            for m in conv if m["role"] == "user"]
    prompts = self_written_prompts(engine, tokenizer, eos, n, path, seed, excluded=held)
    return [[{"role": "user", "content": p}] for p in prompts]


def _training_records(args, work: pathlib.Path, shards) -> list[dict]:
    """The scored shards' records, and with --answers-as-labels the kept answers whose
    shards are not built, labelled by their own tokens."""
    from specdec.distill.data import answers_as_labels, load_answers, load_shards, unscored_answers

    records = load_shards(shards)
    if args.answers_as_labels:
        kept = unscored_answers(pathlib.Path(args.answers or work / "answers"), work / "data")
        kept += [p for d in args.more_answers for p in sorted(pathlib.Path(d).glob("answers-*.npz"))]
        records += answers_as_labels([r for p in kept for r in load_answers(p)])
        print(f"{len(kept)} answer files without scores: their tokens are their labels")
    return records


def _start(args, recipe, records: list[dict], eos):
    """(module, arch, vocab_map, recipe, the start draft's meta or None): from target layers,
    or with --init-draft from that draft's own weights and vocabulary."""
    from specdec.distill import train as distill
    from specdec.models import draft_model
    from specdec.models.loading import resolve_draft_spec

    if not args.init_draft:
        vocab_map = distill.build_vocab(records, recipe.vocab, sorted(eos))
        module, arch = distill.init_from_target(recipe, vocab_map)
        return module, arch, vocab_map, recipe, None
    path = resolve_draft_spec(args.init_draft, args.target)
    if not draft_model.is_draft_dir(path):
        raise SystemExit(f"error: --init-draft {args.init_draft!r} is not a specdec draft "
                         "directory")
    meta = draft_model.read_meta(path)
    if meta["target"] != args.target:
        raise SystemExit(f"error: --init-draft {args.init_draft!r} drafts for "
                         f"{meta['target']!r}, not {args.target!r}")
    module, arch, vocab_map = distill.init_from_draft(path)
    grow = tuple(int(x) for x in args.grow.split(",")) if args.grow else ()
    if grow:
        module, arch = distill.grow_draft(module, grow, recipe.target)
    recipe = dataclasses.replace(recipe, vocab=len(vocab_map), layers=grow,
                                 warmup=min(recipe.warmup, recipe.steps))
    return module, arch, vocab_map, recipe, meta


def _command(args) -> str:
    """The training command, as far as its arguments decide the draft."""
    values = ("prompts", "prompt_set", "vocab", "layers", "steps", "batch", "lr", "seed",
              "max_new_tokens", "temperatures", "init_draft", "grow", "answers", "more_answers")
    flags = ("skip_data", "answers_as_labels")
    words = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
             if k in values and v is not None]
    words += [f"--{k.replace('_', '-')}" for k in flags if getattr(args, k, False)]
    return "specdec distill " + " ".join(words)


def cmd_eval(args) -> int:
    from specdec.distill import train as distill
    from specdec.models import draft_model
    from specdec.models.loading import resolve_draft_spec

    spec = resolve_draft_spec(args.draft, "default")
    if not draft_model.is_draft_dir(spec):
        raise SystemExit(f"error: {args.draft!r} is not a specdec draft directory")
    if draft_model.is_feature_draft(spec):
        raise SystemExit(f"error: {args.draft!r} is a feature-conditioned draft: evaluate it "
                         "with specdec distill-feature eval")
    meta = draft_model.read_meta(spec)
    engine, tokenizer, eos = _engine_and_tokenizer(meta["target"])  # once for every set
    report = {}
    for name in args.held_out.split(","):
        held = held_out_records(meta["target"], pathlib.Path(args.work), args.heldout_prompts,
                                args.max_new_tokens, engine, tokenizer, eos,
                                held_out=name.strip())
        report[name.strip()] = distill.evaluate(spec, held, threads=args.threads)
    print(json.dumps(report, indent=2))
    return 0

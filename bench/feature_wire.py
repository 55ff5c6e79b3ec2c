"""What the target's features cost a round on loopback (issue 33: <= 0.3 ms).

Starts the target and a feature-conditioned draft as local service processes and times, side by
side (alternating, median of ``--calls`` each), the two calls of a round with k draft tokens
with and without features: a Verify of one committed token and k draft tokens with
``return_features`` (the target also normalises and sends up to k + 1 feature rows) against
one without; a Propose of k with those rows in ``features`` against one without (on a
session whose features end a position earlier, so both compute the same number of rows).
Each call rolls its session back to the same prefix, so every call does the same work.

    python -m bench.feature_wire [--draft DIR | --feature-layers 2,14] [--k 2] [--calls 200]

The verify asks for the layers the draft reads (its ModelInfo.feature_layers), as the
orchestrator does. Without ``--draft``, an untrained feature draft for the default target is
made for the run, reading ``--feature-layers`` (its cost is a trained one's: the same layer,
head and rows).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import grpc
import torch

from orchestrator.local import LocalServices
from specdec.serving.session import rolling_hash
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc


def _ref(sid: str, tokens: list[int], prefix: int) -> pb.SessionRef:
    return pb.SessionRef(session_id=sid, prefix_len=prefix,
                         prefix_hash=rolling_hash(tokens[:prefix]) if prefix else 0)


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def measure(target_addr: str, draft_addr: str, k: int, calls: int) -> dict:
    prompt = list(range(1000, 1120))
    p = len(prompt)
    with grpc.insecure_channel(target_addr) as tch, grpc.insecure_channel(draft_addr) as dch:
        target, draft = pb_grpc.TargetServiceStub(tch), pb_grpc.DraftServiceStub(dch)
        layers = list(draft.GetInfo(pb.InfoRequest()).feature_layers)
        first = target.Verify(pb.VerifyRequest(session=_ref("v", prompt, 0), tokens=prompt,
                                               return_features=True, features_from=0,
                                               feature_layers=layers))
        feats = first.features  # rows of positions 0 .. p - 1
        row = 2 * feats.dim
        seq = prompt + [first.next_token]
        block = [7, 8, 9, 10, 11, 12, 13, 14][:k]

        def rows(start: int, end: int) -> pb.Features:
            return pb.Features(start=start, dim=feats.dim, data=feats.data[start * row:end * row])

        def verify(with_features: bool):
            return target.Verify(pb.VerifyRequest(
                session=_ref("v", seq, p), tokens=seq[p:], draft_tokens=block,
                return_features=with_features, features_from=0,
                feature_layers=layers if with_features else []))

        # two draft sessions over the prompt: features to p - 2 (+1 row a call) and to p - 3
        for sid, end in (("with", p - 1), ("without", p - 2)):
            draft.Propose(pb.DraftRequest(session=_ref(sid, prompt, 0), tokens=prompt, k=1,
                                          features=rows(0, end)))

        def propose(with_features: bool):
            sid = "with" if with_features else "without"
            return draft.Propose(pb.DraftRequest(
                session=_ref(sid, seq, p), tokens=seq[p:], k=k,
                features=rows(p - 1, p) if with_features else None))

        sizes = {"with": verify(True).ByteSize(), "without": verify(False).ByteSize()}
        times = {name: [] for name in ("verify", "verify+features", "propose",
                                       "propose+features")}
        for i in range(calls + 10):  # 10 warm-up rounds
            for with_features in ((True, False) if i % 2 else (False, True)):
                tv = _ms(lambda: verify(with_features))
                tp = _ms(lambda: propose(with_features))
                if i >= 10:
                    suffix = "+features" if with_features else ""
                    times["verify" + suffix].append(tv)
                    times["propose" + suffix].append(tp)
    med = {name: statistics.median(v) for name, v in times.items()}
    return dict(k=k, calls=calls, feature_dim=feats.dim, feature_layers=layers, median_ms=med,
                verify_extra_ms=med["verify+features"] - med["verify"],
                propose_extra_ms=med["propose+features"] - med["propose"],
                round_extra_ms=med["verify+features"] - med["verify"] +
                med["propose+features"] - med["propose"],
                verify_response_bytes=sizes)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.feature_wire", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", help="a feature draft directory (default: an untrained one)")
    ap.add_argument("--feature-layers", default="",
                    help="the untrained draft reads these target layers too (e.g. 2,14)")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per service")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft
        if draft is None:
            from specdec.models import feature_model as fm

            draft = str(pathlib.Path(tmp) / "draft")
            from specdec.models.loading import check_architecture

            recipe = fm.FeatureRecipe(feature_layers=args.feature_layers)
            n, h = len(recipe.layers), check_architecture("default").hidden_size
            fm.save_draft(draft, fm.init_from_target(recipe, torch.arange(8192), 1.0,
                                                     tap_stats=(torch.zeros(n, h),
                                                                torch.ones(n, h))),
                          "default", {"note": "bench"})
        with LocalServices("default", draft, threads=args.threads) as services:
            result = measure(services.target_addr, services.draft_addr, args.k, args.calls)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

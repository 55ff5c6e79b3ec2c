"""``--mode auto`` and ``--threads 0``: how specdec sets itself up where it runs."""

import argparse
import os

import pytest

from orchestrator.cli import add_generation_arguments, add_pair_arguments, resolve_auto


def parse(*argv):
    p = argparse.ArgumentParser()
    add_generation_arguments(p)
    add_pair_arguments(p)
    args = p.parse_args(list(argv))
    resolve_auto(args)
    return args


def test_local_services_share_the_cores_so_rounds_are_sequential_with_every_core():
    args = parse()
    assert args.mode == "spec"
    assert args.threads == (os.cpu_count() or 1)


def test_remote_services_are_pipelined():
    args = parse("--target-addr", "10.0.0.2:50051", "--draft-addr", "10.0.0.3:50051")
    assert args.mode == "pipelined"


def test_a_local_draft_next_to_a_remote_target_is_pipelined():
    # the draft runs here, the target elsewhere: they do not share compute
    assert parse("--target-addr", "10.0.0.2:50051").mode == "pipelined"


@pytest.mark.parametrize("mode", ["spec", "pipelined", "target-only"])
def test_explicit_choices_are_kept(mode):
    args = parse("--mode", mode, "--threads", "3")
    assert (args.mode, args.threads) == (mode, 3)


def test_local_pipelined_splits_the_cores():
    args = parse("--mode", "pipelined")
    assert args.threads == max(1, (os.cpu_count() or 1) // 2)

"""Generate the wire modules from proto/ with grpcio-tools.

``python -m specdec.wire.generate [--out DIR]`` writes specdec/wire/specdec_pb2*.py under DIR
(default: the repository root).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = "specdec/wire/specdec.proto"
GENERATED = ("specdec_pb2.py", "specdec_pb2.pyi", "specdec_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc on the .proto; return the generated files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    return [out_dir / "specdec" / "wire" / name for name in GENERATED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT)
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())

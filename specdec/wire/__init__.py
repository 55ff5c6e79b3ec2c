"""Python code generated from proto/specdec/wire/specdec.proto (do not edit by hand).

Import ``from specdec.wire import specdec_pb2 as pb, specdec_pb2_grpc as pb_grpc``.
Regenerate with ``python -m specdec.wire.generate``; ``tests/test_wire.py`` fails when the
committed modules are stale.
"""

"""specdec: the shared core of distributed speculative decoding: serving (the model side of a
round, no network code), models (architectures, loading, the draft format), rpc (the gRPC
plumbing of the services), distill (training drafts), config."""

__version__ = "0.1.0"

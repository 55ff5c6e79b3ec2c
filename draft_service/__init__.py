"""The draft model's gRPC service: proposes blocks of k tokens (model or n-gram drafter)."""

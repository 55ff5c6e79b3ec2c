"""The target model's gRPC service: verifies draft blocks in one forward pass."""

"""specdec benchmarks: system comparison and verify-pass cost (specdec bench, bench-verify)."""

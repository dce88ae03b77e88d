"""Benchmarks that print figures (ratios against a baseline run in the same invocation)."""

"""Helpers for tests and benchmarks (not imported by the apps)."""

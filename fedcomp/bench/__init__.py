"""Benchmarks (commands, not tests): ``python -m fedcomp.bench codecs --help``."""

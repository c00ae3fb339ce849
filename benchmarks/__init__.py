"""Benchmarks: side-by-side measurements printing ratios and writing JSON (see each script's docstring)."""

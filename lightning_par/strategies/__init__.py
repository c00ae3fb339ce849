"""Lightning strategies: the adapter (base), the one N-D engine, and its named presets."""

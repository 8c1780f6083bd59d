"""Benchmarks: images/s of feeder beside the loaders users would otherwise pick."""

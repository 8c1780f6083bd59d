"""Leaf modules every other package may import: the error hierarchy, the
command line's error handling, commands built from configuration dataclasses (and
the field declarations they read), the bad-input limits the sharder and the daemon
share, protobuf wire helpers, and the worker threads every stream's decoding
shares (``workers``). Nothing here imports another package of the project."""

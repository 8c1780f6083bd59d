"""The decode engine below the daemon: a batch's JPEG windows to its pixels (decoders,
DALI pipelines, resize, crop windows, devices, the decoded cache, the tuner). It
imports nothing of :mod:`feeder`, so it runs on its own (``bench/`` does)."""

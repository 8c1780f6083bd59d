"""The decode engine below the daemon: a batch's JPEG windows to its pixels (crop
windows, decoders, DALI pipelines, the finishing stage every path ends in, devices,
the decoded cache, the tuner). It imports nothing of :mod:`feeder`, so it runs on its
own (``bench/`` does)."""

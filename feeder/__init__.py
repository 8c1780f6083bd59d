"""The daemon, ``feeder serve``: requests, streams, budgets, decode pipelines, the
gRPC service and its transports' senders, metrics. What starts it on a node is
:mod:`launcher`; the ``feeder`` command line is :mod:`cli`."""

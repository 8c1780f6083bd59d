"""The daemon, ``feeder serve``: requests, streams, budgets, the gRPC service and its
transports' senders, configuration, metrics. What decodes its batches is :mod:`decode`;
what starts it on a node is :mod:`launcher`; the ``feeder`` command line is :mod:`cli`."""

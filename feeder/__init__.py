"""The daemon: ``feeder serve`` (requests, streams, budgets, decode pipelines, the
gRPC service and its transports' senders, metrics), ``feeder run`` (the per-node
launcher) and the ``feeder`` command line (:mod:`feeder.cli`)."""

"""``feeder run``, the per-node unit a training job is wrapped in: it starts (or
joins) the node's daemon (:mod:`feeder`), waits for its health, hands the command its
address and token, supervises the daemon and stops it with the command. Above the
daemon, which it starts as a child process and never imports to serve."""

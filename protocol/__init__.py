"""What the daemon and its clients agree on, declared and checked once, imported by
both sides: the stream request (:mod:`protocol.request`), the epoch plan
(:mod:`protocol.plan`) and a batch's small fields (:mod:`protocol.batch`)."""

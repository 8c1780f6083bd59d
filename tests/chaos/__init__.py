"""A seeded schedule of the faults a cluster makes (daemons killed, stopped, restarted
on their data or on another dataset, streams cancelled for idleness, the object store
stopped, killed, its objects deleted or corrupted for a while, its credentials
rotated) against two ranks reading three epochs from a pool of three daemons over a
real S3 server, and a checker against a fault-free run of the same plan:
``python -m tests.chaos --seeds 20`` (``make chaos``)."""

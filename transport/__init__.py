"""How batch pixels travel from the daemon to the client: shared memory on the same
host, CUDA IPC on the client's GPU, the gRPC payload everywhere else, all behind
one interface (``transport.base``)."""

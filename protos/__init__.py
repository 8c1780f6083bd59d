"""Protocol buffers of the feeder service (``feeder.proto``).

The Python modules ``feeder_pb2`` and ``feeder_pb2_grpc`` are generated from the
``.proto`` by the build (``setup.py``'s build step, which ``pip install`` and wheel
builds run), so an installed feeder needs no protobuf compiler at run time.
"""

"""Where a request's client runs (:class:`ClientHost`), as its request says: what the
daemon chooses a stream's transport by."""

from __future__ import annotations

from dataclasses import dataclass

from protos import feeder_pb2

__all__ = ["ClientHost"]


@dataclass(frozen=True)
class ClientHost:
    """Where the client runs, as its request says (``feeder.v1.ClientHost``): the
    daemon gives a client on its own host (same kernel, same shm filesystem) shared
    memory, and one on the GPU that makes its batches CUDA IPC.

    Attributes:
        boot_id: the client's kernel (``/proc/sys/kernel/random/boot_id``).
        hostname: for messages.
        shm_device: ``st_dev`` of the client's shm directory.
        gpu_uuid: the client's CUDA device, empty for a CPU consumer.
        pid: the client's process (the daemon's per-client limits; 0: not said).
    """

    boot_id: str = ""
    hostname: str = ""
    shm_device: int = 0
    gpu_uuid: str = ""
    pid: int = 0

    @classmethod
    def from_message(cls, message: feeder_pb2.ClientHost) -> ClientHost:
        return cls(message.boot_id, message.hostname, message.shm_device, message.gpu_uuid, message.pid)

    @classmethod
    def of_request(cls, request: feeder_pb2.StreamRequest) -> ClientHost | None:
        """What ``request`` says of where its client runs (None: it did not say)."""
        return cls.from_message(request.client_host) if request.HasField("client_host") else None

    def to_message(self) -> feeder_pb2.ClientHost:
        return feeder_pb2.ClientHost(boot_id=self.boot_id, hostname=self.hostname, shm_device=self.shm_device,
                                     gpu_uuid=self.gpu_uuid, pid=self.pid)

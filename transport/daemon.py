"""The daemon's entry to the transports: one :class:`TransportHub` per daemon picks
a sender for each stream, routes ``ReleaseSlots`` to it, gives back the device rings
of ended streams once no client holds them, and frees everything at shutdown. The
stream code sees only :class:`~transport.base.BatchSender`.

A stream gets the transport its client asked for where it works here, else the next
one down, with one warning per reason: CUDA IPC (asked for, or ``auto`` for batches
made on the client's GPU), then shared memory (asked for, or ``auto`` for a client on
this host), then the gRPC payload.

Usage in the daemon::

    shm.sweep_stale(config.shm_dir)                    # at start
    hub = TransportHub(config)
    sender = hub.open_sender(TransportRequest.of(spec), slot_bytes)  # spec: the parsed request
    try: ... stream ... finally: hub.close_sender(sender)
    hub.release(request.slots)                         # ReleaseSlots
    hub.collect()                                      # now and then (once a second)
    hub.close_all()                                    # SIGTERM / shutdown
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from core.errors import InvalidArgument
from protocol.request import ClientHost, StreamSpec
from protos import feeder_pb2
from transport.base import (
    BatchSender,
    HostIdentity,
    TransportConfig,
    TransportKind,
    TransportUnavailable,
)
from transport.grpc_payload import GrpcPayloadSender
from transport.shm import ShmSender, instance_prefix

__all__ = ["TransportHub", "TransportRequest"]

_log = logging.getLogger(__name__)
# Where a stream's batches go instead, in the fallback warnings.
_SHM, _INLINE = "batches go over shared memory", "batches go inline over gRPC"


@dataclass(frozen=True)
class TransportRequest:
    """What a stream's client asked for: the transport part of its request, read
    with the rest of it (:func:`protocol.request.from_request`, which refuses an
    unknown transport).

    Attributes:
        preference: The transport asked for: AUTO (the best that works), CUDA_IPC,
            SHM (host shared memory, also for a client on the batches' GPU) or GRPC.
        client: Where the client runs, None when it did not say (a remote client).
        prefetch_batches: Batches the client holds ready beyond the one it reads
            (0: not said); a ring covers them.
    """

    preference: TransportKind = TransportKind.AUTO
    client: ClientHost | None = None
    prefetch_batches: int = 0

    @classmethod
    def of(cls, spec: StreamSpec) -> TransportRequest:
        """The transport part of a stream's request."""
        return cls(TransportKind(spec.transport), spec.client_host, spec.prefetch_batches)

    @property
    def gpu_uuid(self) -> str:
        """The client's CUDA device, empty for a CPU consumer."""
        return self.client.gpu_uuid if self.client is not None else ""


class TransportHub:
    """Every stream's sender, by stream id, within one shared-memory budget.

    Args:
        config: Ring sizes, shm directory, budget.
        host: This daemon's identity (read from the system by default).
    """

    def __init__(self, config: TransportConfig, host: HostIdentity | None = None) -> None:
        self.config = config
        self.host = host or HostIdentity.of_this_process(config.shm_dir)
        self.prefix = instance_prefix()
        self._senders: dict[str, BatchSender] = {}
        self._lock = threading.Lock()
        self._streams = 0
        self._warned: set[str] = set()
        self._retiring: list[BatchSender] = []  # closed, with a device ring a client may hold
        self._cuda_used = False

    def open_sender(self, request: TransportRequest, slot_bytes: int, batch_gpu_uuid: str = "",
                    slots: int = 0) -> BatchSender:
        """A sender for a new stream whose batches are at most ``slot_bytes``, with
        ``slots`` ring slots (the config's ``ring_slots`` where 0).

        CUDA IPC when asked for (or AUTO) and the batches are produced on the
        client's GPU (``batch_gpu_uuid``); shared memory when asked for (or AUTO, or
        CUDA IPC did not work) and the client shares this host's ``/dev/shm``;
        otherwise the gRPC payload. Each fallback logs one warning per reason
        (never an error).
        """
        with self._lock:
            self._streams += 1
            stream_id = f"{self.prefix}{self._streams}"
        config = replace(self.config, ring_slots=slots) if slots else self.config
        sender = self._same_host_sender(request, config, stream_id, slot_bytes, batch_gpu_uuid)
        if sender is None:
            sender = GrpcPayloadSender(stream_id, self.config.head_reserve_bytes)
        with self._lock:
            self._senders[stream_id] = sender
        return sender

    def _same_host_sender(
        self, request: TransportRequest, config: TransportConfig, stream_id: str, slot_bytes: int,
        batch_gpu_uuid: str,
    ) -> BatchSender | None:
        wanted = request.preference
        if wanted == TransportKind.GRPC:
            return None
        if request.client is None or not self.host.shares_shm_with(request.client):
            if wanted != TransportKind.AUTO:
                self._fall_back("client-host", f"client {request.client.hostname if request.client else '?'} "
                                "does not share this daemon's /dev/shm", _INLINE)
            return None
        on_clients_gpu = bool(batch_gpu_uuid) and batch_gpu_uuid == request.gpu_uuid
        if wanted == TransportKind.CUDA_IPC and not on_clients_gpu:
            self._fall_back("cuda-device", f"CUDA IPC asked for, but the batches are not made on the client's GPU "
                            f"({request.gpu_uuid or 'the client named none'})", _SHM)
        if wanted in (TransportKind.AUTO, TransportKind.CUDA_IPC) and on_clients_gpu:
            sender = self._try("cuda-ipc", lambda: _cuda_sender(stream_id, config, slot_bytes, batch_gpu_uuid), _SHM)
            if sender is not None:
                self._cuda_used = True
                return sender
        if self.reserved_bytes() + config.ring_slots * slot_bytes > config.shm_budget_bytes:
            self._fall_back("budget", f"shared-memory budget of {self.config.shm_budget_bytes} bytes in use", _INLINE)
            return None
        return self._try("shm", lambda: ShmSender(stream_id, config, slot_bytes), _INLINE)

    def _try(self, reason: str, make: Callable[[], BatchSender], instead: str) -> BatchSender | None:
        try:
            return make()
        except TransportUnavailable as e:
            self._fall_back(reason, str(e), instead)
            return None

    def _fall_back(self, reason: str, detail: str, instead: str) -> None:
        level = logging.DEBUG if reason in self._warned else logging.WARNING
        self._warned.add(reason)
        _log.log(level, "%s: %s", instead, detail)

    def reserved_bytes(self) -> int:
        """Shared memory the open streams hold."""
        with self._lock:
            return sum(s.reserved_bytes for s in self._senders.values())

    def release(self, slots: Iterable[feeder_pb2.SlotRef]) -> int:
        """Hands slots back to their streams (``ReleaseSlots``); slots of streams
        that have ended are ignored.

        Returns:
            How many slots were released.

        Raises:
            InvalidArgument: some slots were not lent (after releasing the others).
        """
        released, errors = 0, []
        for ref in slots:
            with self._lock:
                sender = self._senders.get(ref.stream_id)
            if sender is None:
                continue
            try:
                sender.release(ref.index, ref.generation)
                released += 1
            except InvalidArgument as e:
                errors.append(str(e))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise InvalidArgument(errors[0] + more)
        return released

    def close_sender(self, sender: BatchSender) -> None:
        """Ends a stream's transport (its segment is unlinked; a device ring goes
        once no client holds it, see :meth:`collect`). Idempotent."""
        with self._lock:
            self._senders.pop(sender.stream_id, None)
        sender.close()
        if not sender.retire():
            with self._lock:
                if sender not in self._retiring:
                    self._retiring.append(sender)
        self.collect()

    def collect(self) -> int:
        """Gives back the device rings of ended streams that no client holds any more,
        and frees the CUDA memory given back (``torch.cuda.ipc_collect``). Cheap: the
        daemon calls it once a second.

        Returns:
            Rings of ended streams still held by a client.
        """
        with self._lock:
            self._retiring = [sender for sender in self._retiring if not sender.retire()]
            held, cuda_used = len(self._retiring), self._cuda_used
        if cuda_used:
            _ipc_collect()
        return held

    def close_all(self) -> None:
        """Closes every stream's transport: call it at shutdown (SIGTERM)."""
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            self.close_sender(sender)


def _ipc_collect() -> None:
    import torch

    torch.cuda.ipc_collect()


def _cuda_sender(stream_id: str, config: TransportConfig, slot_bytes: int, gpu_uuid: str) -> BatchSender:
    from transport.cuda_ipc import CudaIpcSender  # torch.cuda only where asked for

    return CudaIpcSender(stream_id, config, slot_bytes, gpu_uuid)

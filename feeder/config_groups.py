"""The records a daemon's configuration (:class:`feeder.config.ServerConfig`) is
grouped into, one per concern: decode threads and tuning, budgets, calls, decoding,
GPU decoding, security, shared memory, the decoded cache, remote datasets. Their
fields are ``feeder serve``'s options, under their own names (``--max-streams``);
the configuration checks them together (some rules span records)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from core.bad_input import DEFAULT_MAX_PIXELS
from core.cli import parse_bytes
from core.fields import cli
from feeder.config_values import (
    DEFAULT_GPU_PREFETCH,
    DEFAULT_LOOKAHEAD,
    DEFAULT_PREFETCH,
    DEFAULT_RING_SLOTS,
    physical_memory_bytes,
    usable_cpus,
)

if TYPE_CHECKING:
    from transport.base import TransportConfig

__all__ = [
    "Budgets", "Calls", "DecodedCacheOptions", "Decoding", "GpuDecoding", "RemoteOptions", "Security", "SharedMemory",
    "Tuning",
]


def _default_memory_bytes() -> int:
    """Half of this machine's (or its container's) memory: the rest is the training job's."""
    return physical_memory_bytes() // 2


@dataclass(frozen=True)
class Tuning:
    """How the decode threads are sized and shared, and what is tuned while streams run.

    Args:
        threads: the node's decode budget: the default CPU decoder's one pool of
            this many worker threads, shared by worker time among the streams with
            work as ``fair_share`` says (``core.workers.FairPool``); where DALI
            decodes, a new pipeline's equal share of it among the open streams and,
            for a GPU rank, at least one pipeline per GPU (at least 1; see
            ``decode.devices.thread_share``). 0 (the default): tuned while streams
            run (``autotune``), from the CPUs this process may use (its affinity, its
            container's CPU limit, at most 8) up to twice as many.
        fair_share: how the decode threads' time is shared among streams with work:
            ``per-stream`` (each stream, that is each rank, an equal share: a job of
            8 ranks gets 8 times a job of 1; right for one job per node) or
            ``per-job`` (each job an equal share, split among its streams, whatever
            its rank count: for a node shared by unrelated jobs). In ``per-job`` a
            process counts as one job whatever it names: the jobs one client process
            names share one share (see ``max_streams_per_peer`` for what a client
            is).
        prefetch: pipeline runs kept in flight per stream. 0 (the default): tuned
            per stream (``autotune``), from 2 up to 4.
        autotune: tune the options left at 0 (``threads``, ``prefetch``) from what
            the streams measure (``decode.autotune``); off: 0 means their defaults.
        lookahead: batches after those in flight whose slow samples (windows many
            times their batch's median area, as of a 12 MP photo) are decoded early,
            spread over the runs between (CPU window decoder); order unchanged. 0: none.
    """

    threads: int = 0
    fair_share: str = "per-stream"
    prefetch: int = 0
    autotune: bool = True
    lookahead: int = DEFAULT_LOOKAHEAD

    @property
    def decode_threads(self) -> int:
        """Decode threads to start with: ``threads``, or the CPUs this process may use, at most 8."""
        return self.threads or min(8, usable_cpus())

    @property
    def stream_prefetch(self) -> int:
        """Runs in flight a stream starts with: ``prefetch``, or 2."""
        return self.prefetch or DEFAULT_PREFETCH

    @property
    def gpu_stream_prefetch(self) -> int:
        """Runs in flight a stream decoding on a GPU starts with: ``prefetch``, or 3."""
        return self.prefetch or DEFAULT_GPU_PREFETCH


@dataclass(frozen=True)
class Budgets:
    """What the streams may take of the daemon: each limit refuses a stream past it as
    resource exhausted, or ends a stream left unread.

    Args:
        queue_batches: ready batches buffered per stream (backpressure bound).
        queue_bytes: bytes of ready batches buffered per stream, a second bound beside
            ``queue_batches`` (one batch is always let through, however large).
            Example: 512M.
        max_batch_size: largest batch a request may ask for.
        max_epoch_samples: longest epoch a mix may ask for (its ``epoch_samples``),
            or its datasets' samples together where they are more: each epoch's order
            is built in memory per stream, about 100 bytes a sample, and a dataset
            smaller than its share is drawn as a seeded permutation per pass (the
            slow case: a 3-sample dataset in 10^6 samples took 3 s). A longer one is
            refused as an invalid argument before anything is planned. The default
            plans in well under a second.
        max_streams: streams open at once; more are refused as resource exhausted.
        max_streams_per_peer: streams one client may hold open, more are refused as
            resource exhausted. A client is a process where the daemon can tell: over
            TCP from this host the process the kernel says holds the connection,
            whatever connections it opens; over the unix socket the pid its request
            names. Else (a client on another host) a connection.
        max_streams_per_address: streams the connections of one address may hold
            open together where the daemon cannot tell their processes (clients on
            other hosts), so that opening more connections does not multiply
            ``max_streams_per_peer``. The default fits a node's job of 8 ranks, each
            with a train and a validation stream and the stream opened ahead of a
            size change.
        max_streams_per_job: streams one job may hold open (its ranks share the
            request's ``job_id``; a request without one is its client's own job). The
            defaults fit two jobs of 8 ranks with train and validation streams, each
            with the stream opened ahead of a size change.
        max_memory_bytes: memory budget of all open streams' working memory together
            (ready queues, batches being made and sent, the pipelines' buffers), each
            estimated from its request (see ``feeder.admission.stream_need_bytes``); a
            stream that would pass it is refused as resource exhausted. Example: 8G.
            Default: half of physical memory (or of the container's limit, where
            lower). Not the whole process: the daemon's
            footprint is at most this plus ``shm_budget_bytes``, ``decoded_cache_bytes``
            and the libraries (``footprint_bytes``).
        idle_timeout_s: a stream whose client has taken no batch for this many
            seconds is cancelled and its memory freed.
        contended_idle_timeout_s: the same, while the node is contended: for twice
            this long after a client was refused for all streams, all memory or all
            pipelines, a stream unread for this many seconds is cancelled, so an unread
            stream never keeps what another client is asking for (a FeederLoader
            reopens a cancelled stream at its cursor when it reads again).
        max_pipelines: built pipelines held at once, lent to streams or idle. Each
            open stream holds one, so keep it at least ``max_streams``: a stream that
            finds all of them lent is refused (RESOURCE_EXHAUSTED); an idle one is dropped,
            oldest first, to build another.
        pipeline_idle_s: an idle pipeline is dropped after this many seconds, with its
            threads and buffers (DALI keeps its peak buffers while a pipeline lives).
    """

    queue_batches: int = 4
    queue_bytes: int = 256 << 20
    max_batch_size: int = 1024
    max_epoch_samples: int = 1 << 14
    max_streams: int = 64
    max_streams_per_peer: int = 16
    max_streams_per_address: int = 32
    max_streams_per_job: int = 32
    max_memory_bytes: int = field(default_factory=_default_memory_bytes)
    idle_timeout_s: float = 600.0
    contended_idle_timeout_s: float = 5.0
    max_pipelines: int = 64
    pipeline_idle_s: float = 30.0


@dataclass(frozen=True)
class Calls:
    """The threads and waits of the gRPC calls and of the metrics endpoint's
    connections.

    Args:
        rpc_threads: gRPC worker threads (each open stream holds one); 0: enough for
            ``max_streams`` streams and a few unary calls. Calls waiting for their
            request message have ``max_waiting_calls`` threads more.
        first_message_timeout_s: a call whose request message has not come this many
            seconds after the call began is cancelled (clients send it with the call;
            a waiting call holds a gRPC worker thread).
        max_waiting_calls: calls that may wait for their request message at once,
            each on a gRPC thread beyond ``rpc_threads``; a call past it cancels the
            one that has waited longest and waits in its place (a call with its request
            passes in microseconds, so silent calls cannot keep it out). Calls without
            the token are refused before they wait; health
            checks have a small gate and threads of their own. The default takes the
            burst of a node's ranks starting together (their requests come with their
            calls, but arrive at once).
        metrics_threads: threads serving the metrics endpoint; more connections wait
            for one, 16 per thread at most (past that the oldest waiting is closed).
        metrics_timeout_s: seconds a metrics connection may take in all, counted from
            its accept: a client that has not sent its request by then is cut off.
    """

    rpc_threads: int = 0
    first_message_timeout_s: float = 10.0
    max_waiting_calls: int = 64
    metrics_threads: int = 4
    metrics_timeout_s: float = 5.0


@dataclass(frozen=True)
class Decoding:
    """How samples become pixels on the CPU, and what is done with a sample that cannot
    be served.

    Args:
        antialias: resize filter of streams that do not choose one: plain bilinear
            (False: tf.data's filter; 1.75x the images/s of the antialiased one on 2
            CPU cores at 224 px) or antialiased bilinear (True: torchvision's PIL path).
        cpu_decoder: what decodes JPEG windows on the CPU, by its name in the decoder
            registry (``decode.registry``): ``libjpeg-turbo`` (feeder's window decoder:
            0.25 CPU ms per window of the sample data against 0.43), ``dali`` (DALI's
            ROI decode), or ``auto``: the first that can run here.
        on_error: what a stream does with a sample it cannot serve (one that fails to
            decode, or over ``max_pixels``): ``skip`` replaces it by a repeat of a good
            sample of its batch, marked as padding, counts and names it (in GetStats
            and the log); ``fail`` ends the stream with DATA_LOSS naming it.
        max_pixels: largest width x height (as the index says) served; a larger sample
            is refused before it is read or decoded, as ``on_error`` says. Default:
            Pillow's decompression-bomb threshold (about 9459 x 9459).
        max_failed_batch_fraction: under ``on_error skip``, a batch of which more than
            this share could not be served (did not decode, or its bytes differ from
            their checksum) ends the stream with DATA_LOSS naming the tars: a damaged
            or rewritten shard, not one bad image.
        max_failed_epoch_fraction: likewise for the samples replaced in an epoch so
            far, as a share of the rank's part of it (at least half a batch is always
            allowed).
    """

    antialias: bool = False
    cpu_decoder: str = "auto"
    on_error: str = "skip"
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_failed_batch_fraction: float = 0.5
    max_failed_epoch_fraction: float = 0.01


@dataclass(frozen=True)
class GpuDecoding:
    """How a stream decoding on a GPU shares its work between the GPU and the CPU.

    Args:
        hw_decoder_load: on a GPU, the share of each batch's JPEG data decoded by
            the GPU's hardware JPEG engines (separate from the SMs the training step
            uses). Default: by GPU model, 0.99 on Hopper and Blackwell (NVIDIA's
            MLPerf ResNet-50 setting on H100/H200), else DALI's 0.65.
        cpu_decode_share: on a GPU, the share of each batch decoded and resized on
            the daemon's CPU workers and uploaded into the batch (no SM time): 0 all
            on the GPU, 1 all on the CPU. Default: tuned per pipeline from what it
            measures, as much on the CPU as keeps up with the consumer (see
            ``docs/serving.md``, On GPU nodes); 0 where the window decoder was not built.
    """

    hw_decoder_load: float | None = None
    cpu_decode_share: float | None = None


@dataclass(frozen=True)
class Security:
    """Who may call the daemon: TLS on its port and the token every call carries.

    Args:
        tls_cert: PEM certificate (chain) of the gRPC port; with ``tls_key``, the port
            speaks TLS only.
        tls_key: PEM private key of ``tls_cert``.
        tls_client_ca: PEM CA certificates; when given, clients must present a
            certificate signed by one of them (mutual TLS).
        token_file: file holding a token every call but the health check must carry
            as ``authorization: Bearer <token>`` metadata.
        insecure: allow a non-loopback ``bind`` without TLS and a token.
    """

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    token_file: Path | None = None
    insecure: bool = False


@dataclass(frozen=True)
class SharedMemory:
    """The shared-memory rings that carry batches to clients on this host.

    Args:
        shm_dir: tmpfs where same-host clients' shared-memory rings live.
        ring_slots: batches a same-host stream may have lent out at once (being
            queued, sent or held by the client); must cover the daemon's
            ``queue_batches`` plus the client's prefetch, or batches wait for slots.
            0 (the default): exactly that, per stream: ``queue_batches`` + the
            prefetch the client says it keeps + 2 (the batch it reads, one on the wire).
        shm_budget_bytes: shared memory all rings together may take (in /dev/shm,
            counted in the daemon's resident memory once written, beside
            ``max_memory_bytes``); a stream past it (or a ``/dev/shm`` too small or
            full) is sent over the gRPC payload. Example: 16G.
    """

    shm_dir: Path = Path("/dev/shm")
    ring_slots: int = 0
    shm_budget_bytes: int = 4 << 30

    @property
    def transport(self) -> TransportConfig:
        """The transports' settings."""
        from transport.base import TransportConfig

        return TransportConfig(shm_dir=self.shm_dir, ring_slots=self.ring_slots or DEFAULT_RING_SLOTS,
                               shm_budget_bytes=self.shm_budget_bytes)


@dataclass(frozen=True)
class DecodedCacheOptions:
    """The decoded cache: decoded images kept in RAM for every stream and job.

    Args:
        decoded_cache_bytes: budget of the decoded cache (decoded images kept in RAM,
            shared by every stream and job; see decode.decoded_cache), e.g. 8G or
            512M; 0, the default, turns it off, because cached pixels are downscaled
            ones (see ``decoded_cache_side``). Refused when larger than the machine's
            memory.
        decoded_cache_side: cached images keep their shorter side at most this many
            pixels; streams asking for a larger image_size decode from JPEG (counted).
    """

    decoded_cache_bytes: int = 0
    decoded_cache_side: int = 256


@dataclass(frozen=True)
class RemoteOptions:
    """How datasets in object stores are read: the store, its retries, the node-local
    shard cache.

    Args:
        s3_endpoint: the S3 API of an S3-compatible store (MinIO, SeaweedFS, Ceph),
            e.g. http://127.0.0.1:8333; default: AWS_ENDPOINT_URL, else AWS itself.
        cache_dir: node-local shard cache of remote datasets (a local disk, e.g.
            /nvme/feeder): each remote shard is fetched whole in the background the
            first time it is read, checked against the manifest's sha256, and read
            locally from then on; kept across restarts, shared by every stream and
            job of this daemon (a second daemon is refused it). None, the default:
            ranged reads only.
        cache_bytes: budget of ``cache_dir``, e.g. 800G; the least recently used shard
            not being read is evicted past it; smaller than a shard: ranged reads
            only. Default: 100G.
        cache_fetch_bytes_per_s: the most bytes per second each background shard
            download takes (two run at once), e.g. 200M, so downloads leave the ranged
            reads of current batches their bandwidth; 0, the default: no limit.
        store_requests: ranged GETs in flight at once per remote dataset, all its
            streams together (each dataset has its own: a slow store never holds
            another dataset's streams). 16 reads 0.9-1.0 thousand 40 KB samples/s from
            a SeaweedFS on the same 2-core machine, against 0.5-0.6 with 4 and 0.7-0.8
            with 8.
        store_retry_window_s: a remote read that keeps failing transiently (5xx,
            throttling, timeouts, connections refused or reset) is retried with
            backoff for this many seconds; then the stream ends with UNAVAILABLE
            naming the URL (the loader reconnects).
        store_heal_s: a shard the store says is missing, or whose bytes differ from
            the index, is read again with backoff for this many seconds before its
            samples count as bad (an overwrite or a re-upload under way); once past
            it, that shard's failures count at once, and what the store said is
            forgotten when the object changes, exists again, or after 5 minutes.
            0: at once.
    """

    s3_endpoint: str | None = None
    cache_dir: Path | None = None
    cache_bytes: int = 100 << 30
    cache_fetch_bytes_per_s: int = field(default=0, metadata=cli(parse=parse_bytes))
    store_requests: int = 16
    store_retry_window_s: float = 60.0
    store_heal_s: float = 10.0

"""The daemons one loader draws from (a pool): which are usable now, which failed and
when to try them again, and that they all serve the same dataset.

Any daemon serving the same dataset from the same manifest makes the same pixels for
a sample (augmentation is a pure function of seed, epoch and key), so a rank may
take each batch from any of them. A member that fails (its stream broke, stalled or
was refused) is tried again after a backoff, by a background probe (``ListDatasets``),
and is usable again once it answers with the same manifest; a member that serves
another manifest is left out, with one line naming both, and so is one that does not
serve the dataset (or one dataset of a mix) at all, once another member does. Host
names are looked up again now and then: a name whose addresses grow grows the pool.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from clients.config import LoaderConfig
from clients.connection import Connection
from clients.spec import SplitInfo
from core.errors import FeederError, NotFound, ServiceUnavailable

__all__ = ["DaemonPool", "Member", "expand_addresses", "expand_named"]

_log = logging.getLogger(__name__)
_FIRST_RETRY_S, _MAX_RETRY_S = 0.5, 8.0  # backoff of a failed member, doubling
_PROBE_TIMEOUT_S = 2.0
_LOOKUP_EVERY_S = 30.0  # how often host names are looked up again


def expand_addresses(addresses: Sequence[str]) -> list[str]:
    """``host:port`` entries with a name that resolves to several addresses, as one
    entry per address (``unix:`` and ``dns:`` targets, and IP addresses, as given)."""
    return list(expand_named(addresses))


def expand_named(addresses: Sequence[str]) -> dict[str, str | None]:
    """As :func:`expand_addresses`, each address with the host name it was found
    under (None: given as it is): a TLS daemon's certificate names the host, not the
    addresses a name resolves to (a Kubernetes Service's pods)."""
    expanded: dict[str, str | None] = {}
    for address in addresses:
        for found, name in _lookup(address):
            expanded.setdefault(found, name)
    return expanded


def _lookup(address: str) -> list[tuple[str, str | None]]:
    if address.startswith(("unix:", "dns:")):
        return [(address, None)]
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return [(address, None)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
    except (OSError, ValueError):
        return [(address, None)]  # gRPC will say what is wrong with it
    ips = sorted({str(info[4][0]) for info in infos})
    if len(ips) <= 1:
        return [(address, None)]
    return [(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", host) for ip in ips]


@dataclass
class Member:
    """One daemon of the pool.

    Attributes:
        address: where it listens.
        connection: the channel to it.
        failed_s: when it last failed (None: usable).
        retry_s: when to probe it again.
        why: what its last failure was.
        first_batches: how long its last streams took to send their first batch (a
            new stream is not stalled before about three times the least of them).
    """

    address: str
    connection: Connection
    failed_s: float | None = None
    retry_s: float = 0.0
    delay_s: float = _FIRST_RETRY_S
    why: str = ""
    manifest_sha256: str = field(default="", repr=False)
    first_batches: deque[float] = field(default_factory=lambda: deque(maxlen=8), repr=False)

    @property
    def first_batch_s(self) -> float:
        """How long its streams take to send their first batch when all is well: the
        least of the last 8 (a store outage's slow first batches do not count); 0 until
        one has."""
        return min(self.first_batches, default=0.0)

    def saw_first_batch(self, seconds: float) -> None:
        """One of its streams sent its first batch ``seconds`` after it was opened."""
        self.first_batches.append(seconds)

    @property
    def usable(self) -> bool:
        return self.failed_s is None

    @property
    def left(self) -> bool:
        """Left for good: never probed or asked again."""
        return self.retry_s == float("inf")


class DaemonPool:
    """The members of one loader's pool. Thread-safe.

    Args:
        config: the loader's configuration (addresses, dataset, split, credentials).
        addresses: the daemons (names resolving to several addresses expanded).
    """

    def __init__(self, config: LoaderConfig, addresses: Sequence[str]) -> None:
        self.config = config
        self._named = list(addresses)
        self.members = [Member(a, Connection(config, a, name)) for a, name in expand_named(addresses).items()]
        self.generation = 0  # moves on whenever a member becomes usable again or is added
        self.split: SplitInfo | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._looked_up_s = time.monotonic()
        self._probe = threading.Thread(target=self._probe_failed, name="feeder-pool", daemon=True)

    # -- membership ----------------------------------------------------------------
    def describe(self, timeout_s: float) -> SplitInfo:
        """What the pool serves (the first member that answers), its members checked
        against it: one of another manifest is left out with one line naming both.

        Raises:
            ServiceUnavailable: no member answered within ``timeout_s``.
            FeederError: what the members refused (e.g. no such dataset), if all did.
        """
        errors: list[FeederError] = []
        lacking: list[tuple[Member, NotFound]] = []
        for member in self.members:
            try:
                info = self._ask(member, timeout_s)
            except NotFound as e:
                errors.append(e)
                lacking.append((member, e))
                continue
            except FeederError as e:
                errors.append(e)
                self._fail(member, str(e))
                continue
            if self.split is None:
                self.split = info
            self._admit(member, info)
        if self.split is None:
            if len(errors) == 1:
                raise errors[0]
            raise ServiceUnavailable("no daemon of the pool answered: " + "; ".join(str(e) for e in errors))
        for member, error in lacking:  # another member serves it all: this one never will
            self.leave(member, str(error))
        self._probe.start()
        return self.split

    def _ask(self, member: Member, timeout_s: float) -> SplitInfo:
        """What ``member`` serves of the loader's dataset, or of each dataset of its mix."""
        config = self.config
        if config.mix:
            return member.connection.describe_mix(config.datasets, config.split, timeout_s)
        return member.connection.describe(config.dataset_name, config.split, timeout_s)

    def _admit(self, member: Member, info: SplitInfo) -> bool:
        """Usable when it serves what the pool does; left out (one line) otherwise."""
        if self.split is None:
            raise ServiceUnavailable("the pool has not been described yet")
        member.manifest_sha256 = info.manifest_sha256
        theirs, ours = info.identity(), self.split.identity()
        if theirs != ours or info.num_samples != self.split.num_samples:
            self._fail(member, "another manifest, index or pixel options", retry=False)
            _log.error("daemon %s serves %s/%s with %s, the pool's is %s: left out of the pool", member.address,
                       self.config.dataset_name, self.config.split, theirs.describe(), ours.describe())
            return False
        return True

    def usable(self) -> list[Member]:
        """The members usable now, in the order given."""
        with self._lock:
            return [m for m in self.members if m.usable]

    def fail(self, member: Member, why: str) -> None:
        """``member`` failed (a stream broke, stalled, or was refused): not used until a
        probe finds it answering again."""
        if member.usable:
            _log.warning("daemon %s of the pool failed (%s); its batches are asked of the others", member.address, why)
        self._fail(member, why)

    def leave(self, member: Member, why: str) -> None:
        """``member`` cannot serve the pool's streams (another dataset, a request it
        refuses, its data broken): never used again, with one line."""
        if not member.left:
            _log.error("daemon %s left the pool for good: %s", member.address, why)
        self._fail(member, why, retry=False)

    def _fail(self, member: Member, why: str, retry: bool = True) -> None:
        with self._lock:
            now = time.monotonic()
            if member.failed_s is None:
                member.failed_s, member.delay_s = now, _FIRST_RETRY_S
            if member.left:
                return
            member.why = why
            member.retry_s = now + member.delay_s if retry else float("inf")
            member.delay_s = min(member.delay_s * 2, _MAX_RETRY_S)
        self._wake.set()

    def add(self, address: str, host_name: str | None = None) -> None:
        """Use ``address`` too, from the next batch on (once it answers); ``host_name``:
        the name it was found under, which its TLS certificate names."""
        with self._lock:
            if any(m.address == address for m in self.members):
                return
            member = Member(address, Connection(self.config, address, host_name), failed_s=time.monotonic(),
                            why="new")
            self.members.append(member)
        self._wake.set()

    def names(self) -> str:
        """Every member's address and state, for messages."""
        with self._lock:
            return ", ".join(f"{m.address} ({m.why or 'ok'})" for m in self.members)

    # -- probing ---------------------------------------------------------------------
    def _probe_failed(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=0.25)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [m for m in self.members if not m.usable and m.retry_s <= now]
            for member in due:
                self._probe_one(member)
            if now - self._looked_up_s > _LOOKUP_EVERY_S:
                self._looked_up_s = now
                self.follow_names()

    def follow_names(self) -> None:
        """Look the pool's host names up again: addresses a name gained join the pool;
        those it lost (a rotating DNS name, a Service scaled down) are left, so no
        batch is asked of a daemon that is gone or now serves someone else."""
        found = expand_named(self._named)
        for address, name in found.items():
            self.add(address, name)
        given = set(self._named)
        for member in list(self.members):
            if member.address not in found and member.address not in given and not member.left:
                self.leave(member, "no longer among the addresses of its host name")
                with self._lock:
                    self.generation += 1  # the shares on it are drawn afresh

    def _probe_one(self, member: Member) -> None:
        try:
            info = self._ask(member, _PROBE_TIMEOUT_S)
        except NotFound as e:  # serves no such dataset (or one of a mix's) now: it cannot serve the pool's
            self.leave(member, str(e))
            return
        except FeederError as e:
            self._fail(member, str(e))
            return
        if self._admit(member, info):
            with self._lock:
                member.failed_s, member.why = None, ""
                self.generation += 1
            _log.info("daemon %s of the pool answers again; used from the next batch", member.address)

    def close(self) -> None:
        """Stop probing and close every member's channel."""
        self._closed = True
        self._wake.set()
        if self._probe.is_alive():
            self._probe.join(timeout=5)
        for member in self.members:
            member.connection.close()

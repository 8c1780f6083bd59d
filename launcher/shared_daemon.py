"""The daemon already serving on a node, as ``feeder run`` finds it before it shares it.

A launcher shares it only where it serves what the launcher would: each dataset named
must be served under its name with the same identity (the manifest's and each split's
index's digests, and the options that change pixels; :mod:`protocol.identity`) as the
launcher's own directory and options give, else the job would train on other data or
other pixels without a word: the launcher stops with one line naming both. Serve
options it was given that the daemon does not have are named in one warning (the
shared daemon keeps its own), and the command is given the daemon's own
shared-memory directory, not the launcher's ``--shm-dir``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from core.errors import ConfigError, IdentityMismatch
from feeder.config import ServerConfig
from feeder.serve_options import given_fields, option_texts
from protocol.identity import Identity, differing, digest_for
from protos import feeder_pb2, feeder_pb2_grpc
from shards.digests import DatasetDigests, dataset_digests
from shards.store import StoreOptions

__all__ = ["SharedDaemon"]

_WHY = "another dataset under the name, re-sharded, or other --antialias / --max-pixels / --decoded-cache-side"
# What a launcher refused at the start does.
NOT_SHARED = "not shared; give another --port or --socket-path for a daemon of its own"


@dataclass(frozen=True)
class SharedDaemon:
    """What the daemon serving at ``address`` says it serves (its ``ListDatasets``)."""

    address: str
    reply: feeder_pb2.ListDatasetsResponse

    @classmethod
    def ask(cls, address: str, token: str | None) -> SharedDaemon:
        """Ask the daemon at ``address`` (with ``token``, if it needs one).

        Raises:
            ConfigError: it refused the call (a token it does not take, say).
        """
        metadata = [("authorization", f"Bearer {token}")] if token else []
        with grpc.insecure_channel(address) as channel:
            try:
                reply = feeder_pb2_grpc.FeederStub(channel).ListDatasets(
                    feeder_pb2.ListDatasetsRequest(), timeout=10, metadata=metadata)
            except grpc.RpcError as e:
                raise ConfigError(f"the daemon serving on {address} refused ListDatasets ({e.code().name}): "
                                  "give its --token-file") from e
        return cls(address, reply)

    def check_datasets(self, config: ServerConfig, then: str = NOT_SHARED) -> None:
        """Refuse to share unless the daemon serves every dataset of ``config`` as
        ``config`` would (``then``: what the message ends with, what comes of it).

        Raises:
            ConfigError: a dataset it does not serve.
            IdentityMismatch: one it serves with another identity (names both).
            NotFound, DataError: a dataset directory of ``config`` is not one.
        """
        served = {info.name: info for info in self.reply.datasets}
        missing = sorted(set(config.datasets) - set(served))
        if missing:
            raise ConfigError(f"datasets: the daemon already serving on {self.address} does not serve "
                              f"{', '.join(missing)}: {then}")
        store = StoreOptions(endpoint_url=config.remote.s3_endpoint, retry_window_s=config.remote.store_retry_window_s)
        for name, root in sorted(config.datasets.items()):
            self._check_one(name, root, dataset_digests(root, store), served[name], config.pixel_options, then)

    def _check_one(self, name: str, root: Path | str, ours: DatasetDigests, theirs: feeder_pb2.DatasetInfo,
                   pixels: Mapping[str, str], then: str) -> None:
        their_splits = {split.name: split.index_sha256 for split in theirs.splits}
        their_pixels = dict(self.reply.pixel_options)
        for split in sorted(ours.index_sha256):
            mine = Identity(ours.manifest_sha256, ours.index_sha256[split], digest_for(pixels, None))
            served = Identity(theirs.manifest_sha256, their_splits.get(split, ""), digest_for(their_pixels, None))
            if differing(mine, served):
                raise IdentityMismatch(
                    f"datasets: {name}={root} is {mine.describe()}{_pixel_detail(pixels, their_pixels)}; the daemon "
                    f"already serving on {self.address} serves {name}/{split} as {served.describe()} ({_WHY}): {then}")

    def options_not_had(self, config: ServerConfig, serve_args: Sequence[str]) -> list[str]:
        """The serve options given in ``serve_args`` that the daemon does not have, as
        ``--threads 4 (it has 2)``; none from a daemon that does not report its own."""
        theirs = dict(self.reply.serve_options)
        if not theirs:
            return []
        ours = option_texts(config)
        found = []
        for flag in given_fields(serve_args).values():
            if ours[flag] != theirs.get(flag):
                found.append(f"{flag} {ours[flag]} (it has {theirs.get(flag, 'none')})")
        shm_dir = str(Path(config.shm.shm_dir).resolve())
        if any(arg.split("=", 1)[0] == "--shm-dir" for arg in serve_args) and self.reply.shm_dir not in ("", shm_dir):
            found.append(f"--shm-dir {shm_dir} (it has {self.reply.shm_dir})")
        return found

    def shm_dir(self, default: Path) -> Path:
        """Where the daemon's rings are; ``default`` for a daemon that does not say."""
        return Path(self.reply.shm_dir) if self.reply.shm_dir else default


def _pixel_detail(ours: Mapping[str, str], theirs: Mapping[str, str]) -> str:
    """`` (max_pixels 1000000 against 89478485)``: the pixel options that differ, if the
    daemon reports them."""
    if not theirs:
        return ""
    names = sorted(name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name))
    if not names:
        return ""
    return " (" + ", ".join(f"{n} {ours.get(n, '-')} against {theirs.get(n, '-')}" for n in names) + ")"

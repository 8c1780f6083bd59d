"""What a stream's batches must match, on both sides: the dataset (its manifest's and
its split's index's sha256) and the daemon options that change its pixels.

Any two daemons that report the same :class:`Identity` for a request make the same
samples, labels and pixels for it, so a client may take its batches from either, and
a reopened stream continues the plan it started. The loader learns the identity from
``ListDatasets`` and sends it in every ``StreamRequest``; the daemon compares it with
its own on every open (:func:`check`) and refuses a request for anything else.

The pixel options are named here once (:func:`pixel_options`): a daemon reports its
own (its defaults), and each side applies the request's own choice over them
(:func:`digest_for`) before hashing, so a stream that picks its resize filter is not
refused by a daemon whose default differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import IdentityMismatch

__all__ = ["PIXEL_MATH_VERSION", "Identity", "check", "differing", "digest_for", "pixel_options"]

# Bumped whenever the crop windows, flips or resize of a sample change for the same
# inputs: daemons of two versions must not serve one stream.
PIXEL_MATH_VERSION = "1"


def pixel_options(antialias: bool, max_pixels: int, decoded_cache_side: int,
                  augment: Mapping[str, str] | None = None) -> dict[str, str]:
    """A daemon's options that change pixels, as ``ListDatasets`` reports them.

    Args:
        antialias: the resize filter of streams that do not choose one.
        max_pixels: samples with more pixels are replaced, not decoded.
        decoded_cache_side: the side decoded images are cached at (0: no cache):
            crops of cached images are drawn from that copy.
        augment: the photometric steps that are on, by option name, with their
            values; none while they are off, so a daemon that has them off reports
            what one from before they existed does (the same pixels).
    """
    return {"antialias": str(int(antialias)), "max_pixels": str(max_pixels),
            "decoded_cache_side": str(decoded_cache_side), "pixel_math": PIXEL_MATH_VERSION, **(augment or {})}


def digest_for(options: Mapping[str, str], antialias: bool | None) -> str:
    """The sha256 of ``options`` as they apply to a request that asks for
    ``antialias`` (None: the daemon's default); "" for a daemon that reports none."""
    if not options:
        return ""
    applied = dict(options)
    if antialias is not None:
        applied["antialias"] = str(int(antialias))
    canonical = ";".join(f"{name}={applied[name]}" for name in sorted(applied))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Identity:
    """What a stream's batches must match ("" in a field: not known, not checked).

    Attributes:
        manifest_sha256: the dataset's manifest (canonical JSON).
        index_sha256: the split's ``index.parquet``.
        pixel_options_sha256: :func:`digest_for` of the daemon's pixel options.
    """

    manifest_sha256: str = ""
    index_sha256: str = ""
    pixel_options_sha256: str = ""

    def describe(self) -> str:
        """``manifest 1a2b.., index 3c4d.., pixel options 5e6f..`` (12 hex digits each)."""
        return ", ".join(f"{name} {value[:12] or '?'}" for name, value in (
            ("manifest", self.manifest_sha256), ("index", self.index_sha256),
            ("pixel options", self.pixel_options_sha256)))


_FIELDS = ("manifest_sha256", "index_sha256", "pixel_options_sha256")


def differing(expected: Identity, served: Identity) -> list[str]:
    """The fields known on both sides ("" is not known) that differ."""
    return [name for name in _FIELDS if getattr(expected, name) and getattr(served, name)
            and getattr(expected, name) != getattr(served, name)]


def check(expected: Identity, served: Identity, what: str) -> None:
    """Refuse a request that expects other data or pixels than are served.

    Args:
        expected: what the request carries.
        served: what this daemon serves for it.
        what: the dataset and split, for the message.

    Raises:
        IdentityMismatch: a field known on both sides that differs (names both).
    """
    if differing(expected, served):
        raise IdentityMismatch(
            f"{what}: the request expects {expected.describe()}; this daemon serves {served.describe()} (another "
            "dataset under the name, re-sharded, or other --antialias / --max-pixels / --decoded-cache-side / "
            "--jitter-* options)")

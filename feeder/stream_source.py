"""What a stream reads, found for its request: the split of its dataset, or its mix's
datasets' splits as one composite split (:mod:`feeder.mixed_split`), each checked
against what the request expects (:mod:`protocol.identity`), with the plan's input
(the split's size, or the mix) and the memory of bad samples its error policy uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from core.errors import NotFound
from feeder.bad_samples import BadSamples, MixedBadSamples
from feeder.log_lines import clip
from feeder.mixed_split import MixedPart, MixedSplit, SplitView
from protocol.identity import Identity, check, digest_for
from protocol.mix import Mix, union_classes
from protocol.plan import RankPart
from protocol.request import StreamSpec
from protocol.stream_plan import mix_of
from shards.reader import ShardDataset, SplitIndex

__all__ = ["StreamSource", "find_source"]


@dataclass(frozen=True)
class StreamSource:
    """What one stream reads.

    Attributes:
        split: its samples (a mix's composite split).
        plan: what its plan is drawn from: the split's size, or the mix.
        bad: the memory of bad samples of its split (of each dataset of a mix).
    """

    split: SplitView
    plan: int | Mix
    bad: BadSamples | MixedBadSamples

    def part_lengths(self, part: RankPart) -> tuple[int, ...]:
        """Samples of each dataset of a mix in the rank's ``part`` (empty: one dataset)."""
        if isinstance(self.plan, int):
            return ()
        groups = self.bad.groups(part.indices[~part.padding])
        return tuple(int(n) for n in np.bincount(groups, minlength=len(self.plan.sizes)))


def _split(datasets: Mapping[str, ShardDataset], name: str, split: str) -> SplitIndex:
    """The split ``split`` of the dataset served as ``name``.

    Raises:
        NotFound: no such dataset, or no such split of it (names what there is).
    """
    dataset = datasets.get(name)
    if dataset is None:
        raise NotFound(f"dataset: {name!r} is not served here (serving {sorted(datasets)})")
    found = dataset.splits.get(split)
    if found is None:
        raise NotFound(f"split: {name!r} has no split {split!r} (has {sorted(dataset.splits)})")
    return found


def find_source(spec: StreamSpec, datasets: Mapping[str, ShardDataset],
                bad: Mapping[tuple[str, str], BadSamples], pixel_options: Mapping[str, str]) -> StreamSource:
    """What ``spec`` reads, every dataset of it checked against what it expects.

    Args:
        spec: the request.
        datasets: the daemon's datasets by name.
        bad: each split's memory of bad samples, by (dataset, split).
        pixel_options: the daemon's options that change pixels.

    Raises:
        NotFound: a dataset not served, or one without the split.
        IdentityMismatch: a dataset whose manifest, index or pixel options are not
            what the request expects (FAILED_PRECONDITION).
        InvalidArgument: a mix the plan refuses.
    """
    splits = {name: _split(datasets, name, spec.split) for name in spec.datasets}
    for name, expected in spec.identities().items():
        served = Identity(datasets[name].manifest_sha256, splits[name].index_sha256,
                          digest_for(pixel_options, spec.antialias))
        check(expected, served, f"{clip(name)}/{clip(spec.split)}")
    if not spec.mix:
        split = splits[spec.dataset]
        return StreamSource(split, len(split), bad[spec.dataset, spec.split])
    names = spec.datasets
    _, maps = union_classes([datasets[name].classes for name in names])
    mixed = MixedSplit([MixedPart(name, splits[name], labels) for name, labels in zip(names, maps)])
    plan = mix_of(spec, tuple(len(splits[name]) for name in names))
    return StreamSource(mixed, plan, MixedBadSamples([bad[name, spec.split] for name in names], mixed))

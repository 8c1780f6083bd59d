"""A loader's resumable state, at any world size.

One rank's :meth:`FeederLoader.state_dict` says where that rank is: its epoch and
sample cursor, the world size and batch size it ran at, and what the job's earlier
ranks consumed of the epoch (when it was resumed at another size already). The
cursors of the other ranks are not in it: ranks may be a batch apart when one
checkpoints after another, so one rank's copy cannot say what the others consumed.

:func:`merge_states` makes the job's state from every rank's (the trainer gathers them
into its checkpoint); that state loads at any world size and batch size: where the
world size is the one it was saved at, each rank continues at its own cursor; at
another, the epoch's consumed samples (the job's cursors, one :class:`Segment` more)
are taken out of the epoch's order, and the rest is split among the new ranks
(:func:`protocol.plan.remaining_order`). The daemon needs nothing kept: each request
carries the segments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError
from protocol.plan import Segment

__all__ = ["IDENTITY_KEYS", "Resume", "merge_states", "resume", "segments_from", "segments_to"]

# What a state must share with the loader that loads it.
IDENTITY_KEYS = ("dataset", "split", "seed", "manifest_sha256")


def segments_to(segments: Sequence[Segment]) -> list[list[Any]]:
    """Segments as plain lists (for a checkpoint)."""
    return [[s.world_size, list(s.cursors)] for s in segments]


def segments_from(saved: Sequence[Sequence[Any]]) -> tuple[Segment, ...]:
    """Segments back from :func:`segments_to`."""
    return tuple(Segment(int(world), tuple(int(c) for c in cursors)) for world, cursors in saved)


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The job's state from each rank's ``state_dict()``, in any order.

    Raises:
        ConfigError: the states are not of one job (another dataset, split, seed,
            manifest, world size, epoch or history), or a rank is missing or twice.
    """
    if not states:
        raise ConfigError("merge_states: no states")
    first = states[0]
    world = int(first["world_size"])
    same = (*IDENTITY_KEYS, "world_size", "epoch", "consumed")
    for state in states:
        for key in same:
            if state.get(key) != first.get(key):
                raise ConfigError(f"merge_states: rank {state.get('rank')} has {key}={state.get(key)!r}, "
                                  f"rank {first.get('rank')} has {first.get(key)!r}: not the states of one job")
    ranks = sorted(int(state["rank"]) for state in states)
    if ranks != list(range(world)):
        raise ConfigError(f"merge_states: states of ranks {ranks}, the job had {world} ranks")
    by_rank = {int(state["rank"]): state for state in states}
    merged = {key: first[key] for key in (*IDENTITY_KEYS, "world_size", "epoch", "consumed", "batch_size")
              if key in first}
    return merged | {"cursors": [int(by_rank[r]["cursor"]) for r in range(world)]}


@dataclass(frozen=True)
class Resume:
    """Where a loader continues: ``epoch`` from ``cursor`` of its part, the job having
    consumed ``consumed`` of that epoch at earlier world sizes."""

    epoch: int
    cursor: int
    consumed: tuple[Segment, ...]


def resume(state: Mapping[str, Any], rank: int, world_size: int) -> Resume:
    """Where rank ``rank`` of ``world_size`` continues from ``state`` (a job's state
    from :func:`merge_states`, or one rank's ``state_dict()`` at the same world size).

    Raises:
        ConfigError: one rank's state loaded at another world size.
    """
    epoch, consumed = int(state["epoch"]), segments_from(state.get("consumed", ()))
    saved_world = int(state.get("world_size", world_size))
    if "cursors" in state:
        cursors = tuple(int(c) for c in state["cursors"])
        if saved_world == world_size:
            return Resume(epoch, cursors[rank], consumed)
        return Resume(epoch, 0, (*consumed, Segment(saved_world, cursors)))
    if saved_world != world_size:
        raise ConfigError(
            f"loader state is rank {state.get('rank', '?')}'s of {saved_world}: one rank's cursor cannot say what "
            f"the other ranks consumed, so it loads only at world_size {saved_world} (this loader has "
            f"{world_size}); save clients.merge_states() of every rank's state_dict() to resume at another size"
        )
    return Resume(epoch, int(state["cursor"]), consumed)

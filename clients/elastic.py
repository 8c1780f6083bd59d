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

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError
from protocol.plan import Segment

__all__ = ["IDENTITY_KEYS", "Resume", "check_identity", "check_state", "merge_states", "resume", "segments_from",
           "segments_to"]

# What a state must share with the loader that loads it (a mix's: its datasets and
# weights, and its epoch's length, which its plan is a function of).
IDENTITY_KEYS = ("dataset", "split", "seed", "manifest_sha256", "mix", "epoch_samples")


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
    for state in states:
        check_state(state)
    if any("cursor" not in state or "rank" not in state or "world_size" not in state for state in states):
        raise ConfigError("merge_states: expected each rank's own state_dict() (with rank, world_size and cursor)")
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
    from :func:`merge_states`, or rank ``rank``'s own ``state_dict()`` at the same
    world size).

    Raises:
        ConfigError: a state of the wrong shape (one line naming the field), one rank's
            state loaded into another rank or at another world size.
    """
    checked = check_state(state)
    epoch, consumed = checked["epoch"], checked["consumed"]
    saved_world = checked.get("world_size", world_size)
    if "cursors" in checked:
        cursors = checked["cursors"]
        if len(cursors) != saved_world:
            raise ConfigError(f"loader state: cursors: {len(cursors)} of them for world_size {saved_world}")
        if saved_world == world_size:
            return Resume(epoch, cursors[rank], consumed)
        return Resume(epoch, 0, (*consumed, Segment(saved_world, cursors)))
    if saved_world != world_size:
        raise ConfigError(
            f"loader state is rank {checked.get('rank', '?')}'s of {saved_world}: one rank's cursor cannot say what "
            f"the other ranks consumed, so it loads only at world_size {saved_world} (this loader has "
            f"{world_size}); save clients.merge_states() of every rank's state_dict() to resume at another size"
        )
    if checked.get("rank", rank) != rank:
        raise ConfigError(
            f"loader state is rank {checked['rank']}'s; this loader is rank {rank} of {world_size}: its cursor is "
            "where that rank's part stands, not this one's; load each rank's own state, or clients.merge_states() "
            "of every rank's")
    return Resume(epoch, checked["cursor"], consumed)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("a count (an integer of 0 or more)")
    return value


def _counts(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError("a list of counts")
    return tuple(_count(v) for v in value)


def _segments(value: Any) -> tuple[Segment, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError("a list of [world_size, [cursors]]")
    found = []
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise TypeError("a list of [world_size, [cursors]]")
        world, cursors = _count(entry[0]), _counts(entry[1])
        if world < 1 or len(cursors) != world:
            raise TypeError(f"a list of [world_size, [cursors]] ({len(cursors)} cursors for world_size {world})")
        found.append(Segment(world, cursors))
    return tuple(found)


def _weights(value: Any) -> list[list[Any]]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], numbers.Real)
            and not isinstance(p[1], bool) for p in value):
        raise TypeError("a list of [dataset, weight]")
    return [[name, float(weight)] for name, weight in value]


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("an integer")
    return value


# The fields a state may have, each with its reader (which raises TypeError saying what
# the field must be). A state has "cursor" (one rank's) or "cursors" (a merged one).
_FIELDS = {"epoch": _count, "cursor": _count, "cursors": _counts, "rank": _count, "world_size": _count,
           "batch_size": _count, "consumed": _segments, "dataset": _text, "split": _text, "seed": _integer,
           "manifest_sha256": _text, "mix": _weights, "epoch_samples": _count}


def _said(key: str, value: Any) -> str:
    if key == "mix" and value is not None:
        return ",".join(f"{name}={weight:g}" for name, weight in value)
    return repr(value)


def check_identity(checked: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse a state (read by :func:`check_state`) made for other data than ``mine``
    (the loader's dataset, split, seed, manifest, and a mix's weights and epoch
    length; a key the state lacks is not checked, a manifest the loader does not
    know neither).

    Raises:
        ConfigError: one line naming the first field that differs and both values.
    """
    for key in IDENTITY_KEYS:
        ours = mine.get(key)
        if key in checked and checked[key] != ours and (key != "manifest_sha256" or ours):
            raise ConfigError(f"loader state is for {key}={_said(key, checked[key])}, this loader has "
                              f"{_said(key, ours)}")


def check_state(state: Any) -> dict[str, Any]:
    """``state``'s fields, each checked and read (``consumed`` as segments).

    Raises:
        ConfigError: not a mapping, a field of the wrong type or out of range, or no
            cursor (one line naming the field).
    """
    if not isinstance(state, Mapping):
        raise ConfigError(f"loader state: expected a dict (a state_dict()), got {type(state).__name__}")
    checked: dict[str, Any] = {"consumed": ()}
    for name, read in _FIELDS.items():
        if name in state:
            try:
                checked[name] = read(state[name])
            except TypeError as e:
                raise ConfigError(f"loader state: {name}: expected {e}, got {state[name]!r:.80}") from None
    if "epoch" not in checked:
        raise ConfigError("loader state: epoch: missing")
    if ("cursor" in checked) == ("cursors" in checked):
        raise ConfigError("loader state: expected 'cursor' (one rank's state) or 'cursors' (merge_states()), "
                          f"got {'both' if 'cursor' in checked else 'neither'}")
    if checked.get("world_size", 1) < 1:
        raise ConfigError("loader state: world_size: expected 1 or more, got 0")
    return checked

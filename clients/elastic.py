"""A loader's resumable state, at any world size.

One rank's :meth:`FeederLoader.state_dict` says where that rank is: its epoch and
sample cursor, the world size and batch size it ran at, and what the job's earlier
ranks consumed of the epoch (when it was resumed at another size already). The
cursors of the other ranks are not in it: ranks may be a batch apart when one
checkpoints after another, so one rank's copy cannot say what the others consumed,
unless the ranks step together: a state saved in a ``torch.distributed`` group of its
world size (``together``), where every step is collective (DDP), loads into any rank
of that size, its cursor standing for every rank's. That is how a framework that keeps
rank 0's copy alone in its checkpoint (Lightning) resumes each rank on its next sample.

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
from protocol.plan import LastBatch, Segment

__all__ = ["IDENTITY_KEYS", "Resume", "check_identity", "check_state", "merge_states", "resume", "segments_from",
           "segments_to"]

# What a state must share with the loader that loads it: everything its plan is a
# function of (a mix's datasets and weights; the epoch's length, a plain stream's being
# its split's; the last-batch policy the daemon cuts parts by; whether it is shuffled).
IDENTITY_KEYS = ("dataset", "split", "seed", "manifest_sha256", "mix", "epoch_samples", "last_batch", "shuffle")


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
    if saved_world != world_size and checked.get("together", False):  # every rank of it stood at this cursor
        return Resume(epoch, 0, (*consumed, Segment(saved_world, (checked["cursor"],) * saved_world)))
    if saved_world != world_size:
        raise ConfigError(
            f"loader state is rank {checked.get('rank', '?')}'s of {saved_world}: one rank's cursor cannot say what "
            f"the other ranks consumed, so it loads only at world_size {saved_world} (this loader has "
            f"{world_size}); save clients.merge_states() of every rank's state_dict() to resume at another size"
        )
    if checked.get("rank", rank) != rank and not checked.get("together", False):
        raise ConfigError(
            f"loader state is rank {checked['rank']}'s; this loader is rank {rank} of {world_size}: its cursor is "
            "where that rank's part stands, not this one's (it was not saved in a torch.distributed group of "
            f"{world_size}, whose ranks step together); load each rank's own state, or clients.merge_states() of "
            "every rank's")
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


def _policy(value: Any) -> str:
    if value not in _POLICIES:
        raise TypeError(f"one of {', '.join(_POLICIES)}")
    return str(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("true or false")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("an integer")
    return value


# The fields a state may have, each with its reader (which raises TypeError saying what
# the field must be). A state has "cursor" (one rank's) or "cursors" (a merged one).
_FIELDS = {"epoch": _count, "cursor": _count, "cursors": _counts, "rank": _count, "world_size": _count,
           "batch_size": _count, "consumed": _segments, "dataset": _text, "split": _text, "seed": _integer,
           "manifest_sha256": _text, "mix": _weights, "epoch_samples": _count, "last_batch": _policy,
           "shuffle": _flag, "together": _flag}
_POLICIES = tuple(policy.value for policy in LastBatch)


def _said(key: str, value: Any) -> str:
    if key == "mix" and value is not None:
        return ",".join(f"{name}={weight:g}" for name, weight in value)
    return repr(value)


# Keys every state has had: one a state lacks was left out by hand, and is not checked.
_ALWAYS_SAVED = ("dataset", "split", "seed", "manifest_sha256")


def _plan_mix(value: Any) -> Any:
    """A mix as its plan sees it: a mix of one dataset is that dataset's passes,
    whatever its weight (its epoch's length, compared on its own, says the rest)."""
    return None if value is None or len(value) == 1 else value


class _WholeSplit:
    """The epoch of a plain state from before its length was saved: its split's samples."""

    def __repr__(self) -> str:
        return "its whole split"


def _unsaid(checked: Mapping[str, Any], key: str, mine: Mapping[str, Any]) -> Any:
    """What a state from before ``key`` was saved had: a plain stream's epoch over its
    whole split (the loader's epoch, where the loader is plain too: the dataset, split
    and manifest are checked first), ``drop``, and shuffled exactly under train
    augmentation (the loader's ``augment``: a job resumes with its transform); None
    where nothing can be said."""
    if key == "epoch_samples":
        if "mix" in checked:
            return None
        return mine.get(key) if "mix" not in mine else _WholeSplit()
    return {"last_batch": LastBatch.DROP.value, "shuffle": mine.get("augment") == "train"}.get(key)


def check_identity(checked: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse a state (read by :func:`check_state`) made for another plan than
    ``mine``'s: every key of :data:`IDENTITY_KEYS` must match (the loader's dataset,
    split, seed, manifest, mix, epoch length, last-batch policy and shuffle; a
    manifest the loader does not know is not checked, nor a dataset, split, seed or
    manifest a state made by hand lacks). A key of the plan a state lacks (a state from
    before it was saved) counts as what a loader had then by default: a plain stream
    of its whole split, ``drop``, shuffled under train augmentation.

    Raises:
        ConfigError: one line naming the first field that differs and both values.
    """
    for key in IDENTITY_KEYS:
        ours, said = mine.get(key), key in checked
        if not said and key in _ALWAYS_SAVED or key == "manifest_sha256" and not (said and ours):
            continue
        theirs = checked[key] if said else _unsaid(checked, key, mine)
        if key == "mix":
            theirs, ours = _plan_mix(theirs), _plan_mix(ours)
        if theirs != ours:
            default = "" if said else " (not in the state: the default before it was saved)"
            raise ConfigError(f"loader state is for {key}={_said(key, theirs)}{default}, this loader has "
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

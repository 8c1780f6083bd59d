"""The fault schedule's checker itself: against a reference of a mix, whose small
dataset repeats within an epoch, it counts each sample as often as the reference has
it, and names a lost repeat, an extra repeat and changed pixels."""

from __future__ import annotations

from tests.chaos.run import check

# One rank, one epoch: extra/x twice (its dataset smaller than its share), sample/a once.
REFERENCE = {0: {(0, "sample/a"): (1, "pa", 1), (0, "extra/x"): (4, "px", 2)}}


def _batch(keys: list[str], labels: list[int], hashes: list[str]) -> dict:
    return {"epoch": 0, "keys": keys, "labels": labels, "hashes": hashes, "padding": [False] * len(keys)}


def test_a_repeat_the_plan_makes_is_no_problem() -> None:
    received = {0: [_batch(["sample/a", "extra/x"], [1, 4], ["pa", "px"]), _batch(["extra/x"], [4], ["px"])]}
    assert check(REFERENCE, received, 1) == []


def test_a_lost_repeat_an_extra_repeat_and_other_pixels_are_named() -> None:
    lost = {0: [_batch(["sample/a", "extra/x"], [1, 4], ["pa", "px"])]}
    assert check(REFERENCE, lost, 1) == ["rank 0 epoch 0: 1 lost, 0 twice, 0 not its own (e.g. ['extra/x'])"]
    thrice = {0: [_batch(["sample/a", "extra/x", "extra/x", "extra/x"], [1, 4, 4, 4], ["pa", "px", "px", "px"])]}
    assert check(REFERENCE, thrice, 1) == ["rank 0 epoch 0: 0 lost, 1 twice, 0 not its own (e.g. ['extra/x'])"]
    other = {0: [_batch(["sample/a", "extra/x", "extra/x"], [1, 4, 4], ["pa", "px", "zz"])]}
    assert check(REFERENCE, other, 1) == ["rank 0 epoch 0: extra/x with another label or other pixels"]

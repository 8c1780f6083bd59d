"""Which iteration of a loader takes its batches (:class:`clients.passes.Passes`),
without a daemon: passes, their starts again, and batches taken from two threads."""

from __future__ import annotations

import threading

import pytest

from clients.passes import Passes


def test_a_pass_begun_over_an_unfinished_one_goes_back_to_where_that_one_began():
    passes = Passes()
    first, back = passes.begin((2, 40), "loader")  # a resumed cursor
    assert back is None
    with passes.taking(first, "loader"):
        passes.handed()
    second, back = passes.begin((2, 48), "loader")
    assert back == (2, 40) and passes.restarts == 1
    with pytest.raises(RuntimeError, match="this iterator ended when a new pass began"):
        with passes.taking(first, "loader"):
            pass
    with passes.taking(second, "loader"):
        passes.handed()
    assert passes.begin((2, 48), "loader")[1] == (2, 40)  # from the same start again


def test_a_finished_pass_or_an_explicit_move_leaves_nothing_to_go_back_to():
    passes = Passes()
    number, _ = passes.begin((0, 0), "loader")
    with passes.taking(number, "loader"):
        passes.handed()
        passes.finished((1, 0))
    assert passes.begin((1, 0), "loader")[1] is None
    number, _ = passes.begin((1, 0), "loader")
    with passes.taking(number, "loader"):
        passes.handed()
    passes.moved((4, 0))  # set_epoch(4)
    assert passes.begin((4, 0), "loader")[1] is None and passes.restarts == 0
    assert passes.begin((4, 0), "loader")[1] is None  # a pass that took nothing has nothing to undo


def test_a_batch_taken_while_another_thread_takes_one_is_refused():
    passes = Passes()
    number, _ = passes.begin((0, 0), "loader")
    inside, leave = threading.Event(), threading.Event()

    def take() -> None:
        with passes.taking(number, "loader"):
            inside.set()
            leave.wait(10)

    other = threading.Thread(target=take)
    other.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="being iterated by another thread"):
        with passes.taking(number, "loader"):
            pass
    leave.set()
    other.join()
    with passes.taking(number, "loader"):  # free again
        pass

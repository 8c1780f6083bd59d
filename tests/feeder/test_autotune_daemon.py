"""The daemon's tuner on real streams: knobs changed under a stream leave its batches
as they are, a run more in flight is reserved in the memory budget, and hand-set
options are not tuned."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from feeder.assembly import grant_prefetch
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from protocol.request import StreamSpec


def _service(shards, **options) -> FeederService:
    config = ServerConfig.of(datasets={"sample": shards}, device="cpu", max_batch_size=64, lookahead=0, **options)
    return FeederService(config, open_datasets(config.datasets), ServerMetrics())


def _spec(**fields) -> StreamSpec:
    return StreamSpec(**(dict(dataset="sample", split="train", batch_size=8, image_size=32, seed=3) | fields))


def _batches(service: FeederService, spec: StreamSpec, turn=None) -> list[tuple[list[str], np.ndarray]]:
    """Every batch of ``spec``'s stream (keys and pixels); ``turn(stream)`` between batches."""
    stream = service.open_stream(spec)
    out = []
    for batch in stream:
        out.append((list(batch.meta.keys), np.array(batch.images)))
        if turn is not None:
            turn(stream)
    stream.close()
    return out


def test_threads_and_runs_in_flight_changed_under_a_stream_leave_every_batch_as_it_was(shards):
    spec = _spec(epochs=2)
    hand = _service(shards, threads=2, prefetch=2)
    try:
        expected = _batches(hand, spec)
    finally:
        hand.close()
    tuned = _service(shards)
    settings = iter([(1, 4), (3, 1), (2, 3), (4, 2)] * 100)

    def turn(stream) -> None:
        threads, runs = next(settings)
        tuned.parts.workers.resize(threads)
        assert grant_prefetch(tuned.parts.admission, stream, runs)

    try:
        got = _batches(tuned, spec, turn)
    finally:
        tuned.close()
    assert [keys for keys, _ in got] == [keys for keys, _ in expected]
    for (_, mine), (_, theirs) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_a_run_more_in_flight_is_reserved_in_the_memory_budget_and_refused_past_it(shards):
    service = _service(shards)
    try:
        stream = service.open_stream(_spec())
        (ticket,) = [t for _, t in service.parts.admission.open()]
        assert ticket.run_bytes > 0 and stream.prefetch == 2
        assert grant_prefetch(service.parts.admission, stream, 4)
        (grown,) = [t for _, t in service.parts.admission.open()]
        assert grown.need_bytes == ticket.need_bytes + 2 * ticket.run_bytes and stream.prefetch == 4
        assert grant_prefetch(service.parts.admission, stream, 1)
        (shrunk,) = [t for _, t in service.parts.admission.open()]
        assert shrunk.need_bytes == ticket.need_bytes - ticket.run_bytes
        stream.close()
    finally:
        service.close()


def test_a_run_more_past_the_budget_is_refused_and_nothing_changes(shards):
    probe = _service(shards)
    try:
        stream = probe.open_stream(_spec())
        (ticket,) = [t for _, t in probe.parts.admission.open()]
        stream.close()
    finally:
        probe.close()
    service = _service(shards, max_memory_bytes=ticket.need_bytes + ticket.run_bytes)
    try:
        stream = service.open_stream(_spec())
        assert grant_prefetch(service.parts.admission, stream, 3)  # one run more fits
        assert not grant_prefetch(service.parts.admission, stream, 4)  # a second does not
        assert stream.prefetch == 3
        stream.close()
    finally:
        service.close()


def test_a_pooled_runner_lent_to_the_next_stream_starts_at_the_daemons_prefetch_again(shards):
    service = _service(shards)
    try:
        first = service.open_stream(_spec())
        assert grant_prefetch(service.parts.admission, first, 4)
        runner = first.context.runner
        first.close()
        second = service.open_stream(_spec())
        assert second.context.runner is runner and second.prefetch == 2
        second.close()
    finally:
        service.close()


@pytest.mark.parametrize("options, threads, prefetch", [
    ({}, True, True),
    ({"threads": 2}, False, True),
    ({"prefetch": 3}, True, False),
    ({"autotune": False}, False, False),
])
def test_what_is_given_by_hand_or_with_autotune_off_is_not_tuned(shards, options, threads, prefetch):
    service = _service(shards, **options)
    try:
        assert service.parts.tuner._tune_threads is threads and (service.parts.tuner._grant is not None) is prefetch
        shown = service.metrics.registry.get_sample_value("feeder_tuned_threads")
        assert shown == service.config.tuning.decode_threads  # tuned or hand-set, the threads the pool has
        assert service.parts.workers.threads == service.config.tuning.decode_threads
        assert service.config.tuning.stream_prefetch == options.get("prefetch", 2)
    finally:
        service.close()


def test_the_tuner_runs_beside_streams_and_a_stream_closing_mid_trial_is_forgotten(shards):
    service = _service(shards)
    service.parts.tuner.interval_s = 0.05
    done = threading.Event()

    def read() -> None:
        for _ in range(3):
            stream = service.open_stream(_spec(epochs=1))
            for _ in stream:
                pass
            stream.close()
        done.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        while not done.is_set():
            service.parts.tuner.tick()
            done.wait(0.01)
        reader.join()
        threading.Event().wait(2 * service.parts.tuner.interval_s)
        service.parts.tuner.tick()  # the last stream closed: forgotten, no trial left on it
        assert service.parts.tuner._trial is None and not service.parts.tuner._seen
        assert 1 <= service.parts.workers.threads <= 2 * max(1, service.config.tuning.decode_threads)
    finally:
        service.close()

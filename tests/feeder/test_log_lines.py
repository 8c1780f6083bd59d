"""Log lines bounded: client names cut, client mistakes rate-limited, every line capped."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import grpc
import pytest

from feeder import log_lines
from feeder.log_lines import CLIP_CHARS, LineLimitFilter, RateLimitedLog, clip
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2_grpc
from tests.feeder.conftest import connect, request


def test_clip_cuts_long_names_says_how_long_and_escapes_line_breaks():
    assert clip("imagenet") == "imagenet"
    cut = clip("x" * (1 << 20))
    assert len(cut) < CLIP_CHARS + 30 and cut.endswith("(1048576 chars)")
    assert clip("a\nFAKE ERROR line") == "a\\nFAKE ERROR line"
    assert "\n" not in clip("\n" * 1000)


def _records(name: str) -> tuple[logging.Logger, list[logging.LogRecord]]:
    logger = logging.getLogger(name)
    logger.propagate = False
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    return logger, records


def test_rate_limited_lines_count_what_they_suppress(monkeypatch: pytest.MonkeyPatch):
    # The limiter's seconds are the test's: 50 lines in one second, however slowly they go.
    now = [1000.25]
    monkeypatch.setattr(log_lines, "time", SimpleNamespace(monotonic=lambda: now[0]))
    logger, records = _records("test.rate_limited")
    lines = RateLimitedLog(logger, per_s=3)
    for i in range(50):
        lines.warning("bad", "bad call %d", i)
    lines.warning("other", "another kind")
    now[0] += 1.0
    lines.warning("bad", "bad call %d", 50)  # a new second: written, with the count it owes
    lines.flush()
    messages = [r.getMessage() for r in records]
    written = [m for m in messages if m.startswith("bad call")]
    assert written == ["bad call 0", "bad call 1", "bad call 2", "bad call 50"]  # 3 a second
    assert "bad: suppressed 47 similar line(s)" in messages
    assert "another kind" in messages, "kinds are limited apart"


def test_line_limit_filter_caps_any_line():
    logger, records = _records("test.line_limit")
    logger.handlers[0].addFilter(LineLimitFilter(100))
    logger.warning("job %s opened", "j" * 10_000)
    logger.warning("short")
    assert len(records[0].getMessage()) < 160 and "10011 chars" in records[0].getMessage()
    assert records[1].getMessage() == "short"


# -- a real daemon ----------------------------------------------------------------

@pytest.mark.slow
def test_a_daemon_writes_bounded_lines_whatever_clients_send(shards):
    lines: list[str] = []
    huge = "n" * (1 << 20)
    with DaemonProcess({"sample": shards}, ("--device", "cpu", "--threads", "1"), echo=lines.append) as daemon:
        port = int(daemon.address.rsplit(":", 1)[1])
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            for fields in (dict(dataset=huge), dict(split=huge)):
                with pytest.raises(grpc.RpcError) as caught:
                    next(stub.StreamBatches(request(**fields), timeout=30))
                assert len(caught.value.details()) < 1000, "the status is bounded too"
            assert len(list(stub.StreamBatches(request(job_id=huge, max_samples=5), timeout=30))) == 1
            first_s = time.monotonic()  # the daemon's seconds too (CLOCK_MONOTONIC, one per machine)
            for _ in range(20):
                with pytest.raises(grpc.RpcError):
                    channel.unary_unary("/feeder.v1.Feeder/StreamBatches")(b"\xff\xff\xff\xff", timeout=10)
            last_s = time.monotonic()
    assert lines, "the daemon wrote its log"
    assert max(len(line) for line in lines) < 4096 + 200, "every line is bounded"
    assert not [line for line in lines if "Traceback" in line]
    malformed = [line for line in lines if "malformed request message" in line]
    counted = (re.search(r"malformed request: suppressed (\d+)", line) for line in lines)
    suppressed = sum(int(m.group(1)) for m in counted if m)
    assert len(malformed) + suppressed == 20, "one line per malformed call, or counted in a suppressed line"
    # At most 5 a second over the seconds the calls took, each logged before its answer.
    assert 1 <= len(malformed) <= 5 * (int(last_s) - int(first_s) + 1), "rate-limited"

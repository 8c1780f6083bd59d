"""Log lines bounded: client names cut, client mistakes rate-limited, every line capped."""

from __future__ import annotations

import logging
import re

import grpc
import pytest

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


def test_rate_limited_lines_count_what_they_suppress():
    logger, records = _records("test.rate_limited")
    lines = RateLimitedLog(logger, per_s=3)
    for i in range(50):
        lines.warning("bad", "bad call %d", i)
    lines.warning("other", "another kind")
    lines.flush()
    written = [r.getMessage() for r in records if r.getMessage().startswith("bad call")]
    suppressed = sum(int(m.group(1)) for r in records if (m := re.search(r"bad: suppressed (\d+)", r.getMessage())))
    assert 3 <= len(written) <= 6  # 3 a second; the calls may straddle a second
    assert len(written) + suppressed == 50
    assert any(r.getMessage() == "another kind" for r in records), "kinds are limited apart"


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
            for _ in range(20):
                with pytest.raises(grpc.RpcError):
                    channel.unary_unary("/feeder.v1.Feeder/StreamBatches")(b"\xff\xff\xff\xff", timeout=10)
    assert lines, "the daemon wrote its log"
    assert max(len(line) for line in lines) < 4096 + 200, "every line is bounded"
    assert not [line for line in lines if "Traceback" in line]
    malformed = [line for line in lines if "malformed request message" in line]
    assert 1 <= len(malformed) <= 10, "one line per malformed call, rate-limited"

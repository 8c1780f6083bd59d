"""ServerConfig and ``--dataset`` parsing reject what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.cli import parse_bytes
from core.errors import ConfigError
from feeder.commands import parse_datasets
from feeder.config import ServerConfig
from feeder.config_values import usable_cpus

OK = {"datasets": {"d": Path("/x")}}


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"datasets": {}}, "datasets"),
        ({"datasets": {"a/b": Path("/x")}}, "dataset name"),
        ({"device": "tpu"}, "device"),
        ({"port": 70000}, "port"),
        ({"metrics_port": -1}, "metrics_port"),
        ({"threads": -1}, "threads"),
        ({"prefetch": -1}, "prefetch"),
        ({"queue_batches": 0}, "queue_batches"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_epoch_samples": 0}, "max_epoch_samples"),
        ({"grace_s": -1.0}, "grace_s"),
        ({"queue_bytes": 0}, "queue_bytes"),
        ({"max_streams_per_peer": 0}, "max_streams_per_peer"),
        ({"max_streams_per_address": 0}, "max_streams_per_address"),
        ({"fair_share": "per-rank"}, "fair_share: 'per-rank' is not one of per-job, per-stream"),
        ({"max_memory_bytes": 0}, "max_memory_bytes"),
        ({"idle_timeout_s": 0.0}, "idle_timeout_s"),
        ({"idle_timeout_s": float("nan")}, "idle_timeout_s"),
        ({"on_error": "ignore"}, "on_error"),
        ({"max_pixels": 0}, "max_pixels"),
        ({"max_pipelines": 0}, "max_pipelines"),
        ({"pipeline_idle_s": float("nan")}, "pipeline_idle_s"),
        ({"store_requests": 0}, "store_requests"),
        ({"first_message_timeout_s": 0.0}, "first_message_timeout_s"),
        ({"first_message_timeout_s": float("nan")}, "first_message_timeout_s"),
        ({"max_waiting_calls": 0}, "max_waiting_calls"),
        ({"metrics_threads": 0}, "metrics_threads"),
        ({"metrics_timeout_s": -1.0}, "metrics_timeout_s"),
    ],
)
def test_bad_values_name_the_field(fields, name):
    with pytest.raises(ConfigError, match=name):
        ServerConfig.of(**(OK | fields))


def test_defaults_are_loopback_and_a_bounded_worker_pool():
    config = ServerConfig.of(**OK)
    assert config.bind == "127.0.0.1" and config.port == 50051
    assert config.worker_threads == config.budgets.max_streams + 4


def test_parse_datasets():
    assert parse_datasets(["a=/data/a", "b=rel/b"]) == {"a": Path("/data/a"), "b": Path("rel/b")}
    for bad in (["nopath"], ["=x"], ["a=x", "a=y"], ["a=s3://b/../x"]):
        with pytest.raises(ConfigError, match="--dataset"):
            parse_datasets(bad)


def test_store_urls_stay_urls_and_file_urls_are_paths():
    found = parse_datasets(["w=s3://bucket/shards/", "g=gs://b/p", "f=file:///data/f"])
    assert found == {"w": "s3://bucket/shards", "g": "gs://b/p", "f": Path("/data/f")}
    config = ServerConfig.of(datasets=found)
    assert config.remote_datasets == ["w", "g"] and config.remote.cache_dir is None


def test_remote_options_are_checked():
    with pytest.raises(ConfigError, match="s3_endpoint"):
        ServerConfig.of(**OK, s3_endpoint="localhost:9000")
    with pytest.raises(ConfigError, match="cache_bytes"):
        ServerConfig.of(**OK, cache_bytes=-1)


@pytest.mark.parametrize("text,value", [
    ("8G", 8 << 30), ("8g", 8 << 30), ("512M", 512 << 20), ("1.5G", 3 << 29), ("64K", 64 << 10),
    ("1T", 1 << 40), ("1000", 1000), ("2GiB", 2 << 30), ("300MB", 300 << 20),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text, "--max-memory") == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "8X", "nanG", "infG", "1e400"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match="--max-memory"):
        parse_bytes(text, "--max-memory")


def test_budget_defaults():
    config = ServerConfig.of(**OK)
    assert 0 < config.budgets.max_memory_bytes and config.budgets.max_streams_per_peer < config.budgets.max_streams
    assert config.budgets.idle_timeout_s > 0 and config.budgets.queue_bytes > 0


def test_serve_refuses_a_bad_size_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from cli.app import app

    result = CliRunner().invoke(app, ["serve", "--dataset", f"d={tmp_path}", "--max-memory-bytes", "8X"])
    assert result.exit_code == 1
    expected = "feeder: error: --max-memory-bytes '8X': expected a size such as 8G, 512M or 1073741824"
    assert result.output.strip() == expected


def test_serve_refuses_a_fair_share_it_does_not_know_with_one_line(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "feeder", "serve", "--dataset", f"d={tmp_path}", "--fair-share",
                          "bogus"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert run.stderr.strip() == "feeder: error: fair_share: 'bogus' is not one of per-job, per-stream", run.stderr


def test_the_fair_share_is_an_option_of_serve_with_its_default():
    config = ServerConfig.of(**OK)
    assert config.tuning.fair_share == "per-stream"
    assert ServerConfig.of(**(OK | {"fair_share": "per-job"})).tuning.fair_share == "per-job"


def test_a_containers_cgroup_limits_are_the_machine_the_defaults_are_sized_on(tmp_path, monkeypatch):
    from feeder.config_values import physical_memory_bytes, usable_cpus

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("4294967296\n")  # a pod limited to 4 GiB and 1.5 CPUs
    (v2 / "cpu.max").write_text("150000 100000\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert physical_memory_bytes(v2) == min(4 << 30, physical_memory_bytes(tmp_path / "none"))
    assert usable_cpus(v2) == 2  # the quota rounded up
    (v2 / "memory.max").write_text("max\n")
    (v2 / "cpu.max").write_text("max 100000\n")
    assert physical_memory_bytes(v2) == physical_memory_bytes(tmp_path / "none")  # no limit: the machine's
    assert usable_cpus(v2) == 16
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(v1) == 3
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert usable_cpus(v1) == 16
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # taskset, or Slurm's --cpus-per-task
    assert usable_cpus(tmp_path / "none") == 2


def test_the_transport_and_the_daemon_have_one_ring_size_by_default(tmp_path):
    from transport.base import TransportConfig

    daemon = ServerConfig.of(datasets={"d": tmp_path})
    assert daemon.shm.ring_slots == 0  # sized per stream
    assert daemon.shm.transport.ring_slots == TransportConfig().ring_slots == daemon.stream_ring_slots(0)


def test_a_streams_ring_covers_the_daemons_queue_and_the_clients_prefetch(tmp_path):
    daemon = ServerConfig.of(datasets={"d": tmp_path}, queue_batches=4)
    assert daemon.stream_ring_slots(4) == 10  # 4 queued, 4 held ready, 1 read, 1 on the wire
    assert daemon.stream_ring_slots(16) == 22
    assert ServerConfig.of(datasets={"d": tmp_path}, ring_slots=6).stream_ring_slots(16) == 6  # given: kept
    with pytest.raises(ConfigError, match="ring_slots"):
        ServerConfig.of(datasets={"d": tmp_path}, ring_slots=-1)


def test_gpu_decode_shares_are_checked(tmp_path):
    for name in ("hw_decoder_load", "cpu_decode_share"):
        for bad in (-0.1, 1.5, float("nan")):
            with pytest.raises(ConfigError, match=name):
                ServerConfig.of(datasets={"d": tmp_path}, **{name: bad})
    assert ServerConfig.of(datasets={"d": tmp_path}, cpu_decode_share=1.0).gpu.cpu_decode_share == 1.0


def test_threads_and_prefetch_left_at_0_are_tuned_from_their_defaults_and_given_ones_are_kept():
    tuned = ServerConfig.of(**OK).tuning
    assert (tuned.threads, tuned.prefetch, tuned.autotune) == (0, 0, True)
    assert tuned.decode_threads == min(8, usable_cpus()) and tuned.stream_prefetch == 2
    given = ServerConfig.of(**(OK | {"threads": 5, "prefetch": 3})).tuning
    assert (given.decode_threads, given.stream_prefetch) == (5, 3)

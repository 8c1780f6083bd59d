"""Figures of a run: medians over repeats, several clients added up, ratios to peers."""

from __future__ import annotations

import pytest

from bench.summary import add_ratios, check_targets, merge_results, summarise, summarise_runs

MEMORY = {"peak_pss_bytes": 1, "peak_rss_bytes": 2}


def _client(rank: int, windows: list[tuple[int, float, float]]) -> dict:
    return {
        "rank": rank, "setup_s": 0.5, "batches": 10, "problems": [],
        "windows": [{"images": i, "duration_s": d, "cpu_s": c} for i, d, c in windows],
    }


def test_one_client_reports_the_median_window_and_cpu_per_image() -> None:
    windows = [(100, 1.0, 2.0), (300, 1.0, 2.0), (200, 1.0, 2.0)]
    result = {"loader": "inprocess", "cpus": [0], "clients": [_client(0, windows)]}

    row = summarise(result, MEMORY)

    assert row["images_per_s"] == 200
    assert row["images_per_s_repeats"] == [100, 300, 200]
    assert row["cpu_s_per_image"] == pytest.approx(2.0 / 200)
    assert row["cpus_busy"] == 2.0
    assert row["client_spread"] == 0


def test_clients_add_up_per_repeat_and_their_spread_is_reported() -> None:
    # Both clients read the CPU of the same process tree: 3 CPU s per s in all.
    clients = [_client(0, [(300, 1.0, 3.0), (300, 1.0, 3.0)]), _client(1, [(100, 1.0, 3.0), (100, 1.0, 3.0)])]

    row = summarise({"loader": "feeder-shm", "cpus": [0, 1], "clients": clients}, MEMORY)

    assert row["images_per_s"] == 400
    assert row["per_client_images_per_s"] == [300, 100]
    assert row["client_spread"] == pytest.approx((300 - 100) / 200)
    assert row["cpu_s_per_image"] == pytest.approx(3.0 / 400)
    assert row["clients"] == 2


def test_a_failed_client_fails_the_row() -> None:
    clients = [_client(0, [(300, 1.0, 3.0)]), {"rank": 1, "error": "ServiceUnavailable: gone"}]

    row = summarise({"loader": "feeder-shm", "cpus": [0], "clients": clients}, MEMORY)

    assert row["error"] == "ServiceUnavailable: gone"
    assert "images_per_s" not in row


def test_ratios_divide_by_the_peer_in_the_same_run_and_skip_missing_peers() -> None:
    rows = [
        {"loader": "torchvision", "images_per_s": 100.0},
        {"loader": "inprocess", "images_per_s": 250.0},
        {"loader": "decode-only", "error": "broken"},
    ]

    add_ratios(rows)

    assert rows[1]["x_torchvision"] == 2.5 and rows[0]["x_inprocess"] == 0.4
    assert rows[1]["x_decode_only"] is None and rows[2]["x_torchvision"] is None


def test_feeder_targets_are_checked_against_the_peers_that_ran() -> None:
    rows = [
        {"loader": "feeder-shm", "images_per_s": 98.0},
        {"loader": "inprocess", "images_per_s": 100.0},
        {"loader": "torchvision", "images_per_s": 50.0},
    ]

    checks = {c["peer"]: c for c in check_targets(rows)}

    assert set(checks) == {"inprocess", "torchvision"}
    assert checks["inprocess"]["met"] and checks["inprocess"]["achieved_ratio"] == 0.98
    assert not checks["torchvision"]["met"] and checks["torchvision"]["target_images_per_s"] == 100.0
    slow = [{"loader": "feeder-shm", "images_per_s": 60.0}, {"loader": "inprocess", "images_per_s": 100.0}]
    assert not check_targets(slow)[0]["met"]
    failed = [{"loader": "feeder-shm", "error": "down"}, {"loader": "inprocess", "images_per_s": 1.0}]
    assert check_targets(failed) == []


def test_rounds_pool_their_windows_and_keep_the_worst_memory_and_load() -> None:
    def run(windows: list[tuple[int, float, float]], pss: int, load: float) -> dict:
        result = {"loader": "inprocess", "cpus": [0], "clients": [_client(0, windows)]}
        return {"result": result, "memory": {"peak_pss_bytes": pss, "peak_rss_bytes": pss}, "load_average_1m": load}

    row = summarise_runs([run([(100, 1.0, 1.0)], 5, 0.5), run([(300, 1.0, 1.0), (200, 1.0, 1.0)], 7, 2.0)])

    assert row["images_per_s_repeats"] == [100, 300, 200] and row["images_per_s"] == 200
    assert row["peak_pss_bytes"] == 7 and row["load_average_1m"] == 2.0 and row["starts"] == 2
    assert row["batches"] == 20


def test_a_round_that_failed_fails_the_loader() -> None:
    good = {"loader": "inprocess", "cpus": [0], "clients": [_client(0, [(100, 1.0, 1.0)])]}
    runs = [
        {"result": good, "memory": MEMORY, "load_average_1m": 0.0},
        {"result": {"loader": "inprocess", "error": "exit -9: killed"}, "memory": MEMORY, "load_average_1m": 0.0},
    ]

    assert summarise_runs(runs)["error"] == "exit -9: killed"


def test_a_skipped_loader_is_a_row_with_its_reason_and_no_figures() -> None:
    row = summarise({"loader": "tfdata", "skipped": "tensorflow is not installed"}, {"peak_pss_bytes": 1})
    assert row["skipped"] == "tensorflow is not installed" and "images_per_s" not in row
    assert merge_results([{"loader": "tfdata", "skipped": "no tf"}])["skipped"] == "no tf"


def test_epoch_windows_report_the_first_epoch_apart_from_the_later_ones() -> None:
    windows = [(100, 1.0, 2.0), (400, 1.0, 2.0), (300, 1.0, 2.0), (500, 1.0, 2.0)]
    client = _client(0, windows)
    client["windows"][0]["first_epoch"] = True

    row = summarise({"loader": "feeder-grpc", "cpus": [0], "clients": [client]}, MEMORY)

    assert row["epoch1_images_per_s"] == 100
    assert row["epoch1_cpu_s_per_image"] == pytest.approx(2.0 / 100)
    assert row["images_per_s"] == 400, "the row's figure is the later epochs' median"
    assert row["cpu_s_per_image"] == pytest.approx(2.0 / 400)

"""Smoke test of ``bench/pipeline.py`` (the daemon's pipeline alone), which
``bench/gpu_check.sh`` runs on a lent GPU machine: it must at least run on the CPU.

Speed is measured by running the benchmark, never asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import pipeline


def test_the_pipeline_alone_reports_images_per_s_and_its_json(tmp_path: Path, bench_shards: Path) -> None:
    out = tmp_path / "pipeline.json"
    report = pipeline.main([
        "--shards", str(bench_shards), "--image-size", "32", "--batch-size", "8",
        "--warmup-s", "0.1", "--seconds", "0.2", "--repeats", "2", "--json", str(out),
    ])

    assert len(report["images_per_s"]) == 2 and all(r > 0 for r in report["images_per_s"])
    assert report["host_copies"] == 0  # CPU: resized straight into host memory
    assert len(report["cpu_ms_per_image"]) == 2 and all(ms > 0 for ms in report["cpu_ms_per_image"])
    assert 0 < report["checksum_share_of_cpu"] < 1  # a sample's checksum is a part of its work
    assert json.loads(out.read_text())["median_images_per_s"] == report["median_images_per_s"]

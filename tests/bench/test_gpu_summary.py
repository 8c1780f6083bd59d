"""The GPU check's summary, from the files its steps leave (made up here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_summary
from bench.nvml import card_kind

_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.transport.test_cuda_ipc" name="test_batch_arrives" time="1.25"/>
<testcase classname="tests.clients.test_loader_gpu" name="test_two_ranks_on_two_gpus" time="0.01">
<skipped type="pytest.skip" message="needs two CUDA devices">skip</skipped></testcase>
<testcase classname="tests.feeder.test_gpu_streams" name="test_slots" time="45.0">
<failure message="Failed: Timeout &gt;45.0s&#10;stack">trace</failure></testcase>
</testsuite></testsuites>"""


def _row(loader: str, rate: float, **more: object) -> dict:
    return {"loader": loader, "images_per_s": rate, "cpus_busy": 3.0, **more}


def _run(tmp_path: Path, daemon: float, inprocess: float, alone: float, host_copies: int = 0,
         xml: bool = True, card: str = "NVIDIA H200") -> tuple[Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    machine = {"card": card, "kind": card_kind(card), "cores": 16, "window_decoder": "loads", "c_resize": "loads",
               "jpeg_engines": "0 % now (from nvml)", "packages": {"nvidia.dali": "2.4.0 from /tmp/site/x"}}
    (work / "machine.json").write_text(json.dumps(machine))
    rows = [_row("feeder-cuda-ipc", daemon, x_inprocess=daemon / inprocess,
                 daemon={"gpu_host_copies": host_copies, "gpu_batches": 90}),
            _row("inprocess", inprocess)]
    doc = {"config": {"threads": 12, "batch_size": 256}, "results": rows}
    (out / "throughput-224.json").write_text(json.dumps(doc))
    (out / "pipeline-224.json").write_text(json.dumps({"median_images_per_s": alone, "host_copies": 0}))
    if xml:
        (out / "gpu-tests.xml").write_text(_XML)
    (out / "logs.txt").write_text("tests/transport/test_cuda_ipc.py::test_batch_arrives PASSED [ 50%]\n"
                                  "tests/feeder/test_gpu_streams.py::test_slots FAILED [100%]\n")
    (work / "steps.tsv").write_text("machine\tok\t0\t6\t30\t\nthroughput-224\tok\t0\t48\t90\t\n"
                                    "gpu-tests\tkilled at its limit\t124\t110\t110\t"
                                    "killed 1 process(es) left behind: 42\n")
    (work / "gpumem-throughput-224.base").write_text("0, 600\n")
    (work / "gpumem-throughput-224.csv").write_text("0, 600\n0, 5400\n0, 4200\n")
    return out, work


def _sized(fed_ms: float, synthetic_ms: float, idle_fed: float, idle_synthetic: float,
           jpeg: float | None = 30.0) -> dict:
    return {"windows": 3, "steps_per_window": 20, "feeder_step_ms": fed_ms, "synthetic_step_ms": synthetic_ms,
            "feeder_images_per_s": 256_000 / fed_ms, "synthetic_images_per_s": 256_000 / synthetic_ms,
            "feeder_over_synthetic": synthetic_ms / fed_ms, "ratio_range": [0.95, 1.0],
            "feeder_idle_fraction": idle_fed, "synthetic_idle_fraction": idle_synthetic,
            "idle_fed_minus_synthetic": idle_fed - idle_synthetic, "feeder_stall_fraction": 0.01,
            "gpu_percent": 99.0, "jpeg_percent": jpeg, "counters": "nvml" if jpeg is not None else "JPEG engines: "
            "the card has no JPEG engines"}


def _train(out: Path, ratio_224: float, jpeg: float | None = 30.0, complete: bool = True) -> None:
    split = {"sizes": {"224": _sized(54.6 / ratio_224, 54.6, 0.02, 0.01, jpeg),
                       "128": _sized(19.7, 18.7, 0.03, 0.01, jpeg)},
             "transport": "cuda_ipc", "projected_minutes": 12.4, "projection": "projected x: 12.4 min"}
    cpu = dict(split, transport="shm", projected_minutes=20.0)
    doc = {"results": [{"throughput": {"variants": {"split": split, "cpu": cpu}, "synthetic_projected_minutes": 12.2,
                                       "projection_basis": "one GPU's rate with a daemon on all 16 cores",
                                       "windows": [], "complete": complete}}]}
    (out / "train.json").write_text(json.dumps(doc))


def test_the_trainers_figures_and_targets_are_of_the_default_daemons_step_times(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_700, inprocess=12_900, alone=15_000)
    _train(out, ratio_224=0.98)
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    train = {c["target"]: c["met"] for c in summary["targets"] if "trainer" in c["target"] or "JPEG" in c["target"]}
    assert train == {"trainer step fed >= 0.97x synthetic at 224 px": True,
                     "trainer step fed >= 0.95x synthetic at 128 px": False,  # 18.7 of 19.7 ms: 0.949x
                     "hardware JPEG engines busy (> 0 %) in the split daemon's windows at 224 px": True}
    text = gpu_summary.render(summary)
    assert "  split      224    55.7    54.6  0.980   0.950-1.000     2.0%     1.0%   1.0%    99     30  cuda_ipc" \
        in text
    assert "  cpu        128    19.7    18.7  0.949" in text and "split: projected x: 12.4 min" in text
    assert "medians of 3 interleaved windows:" in text and "projections: one GPU's rate" in text
    assert "hardware JPEG engines: 30 % busy in the split daemon's windows at 224 px (NVML): in use" in text
    _train(out, ratio_224=0.90, jpeg=0.0, complete=False)
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    missed = [c["target"] for c in summary["targets"] if c["met"] is False]
    assert "trainer step fed >= 0.97x synthetic at 224 px" in missed and any("JPEG" in m for m in missed)
    text = gpu_summary.render(summary)
    assert "0 % busy in the split daemon's windows at 224 px: not used (DALI decoded on the SMs" in text
    assert "(cut short: the windows that finished)" in text
    assert all(c["met"] is None for c in gpu_summary.summarise_run(out, work, "rehearsal", 300)["targets"])


def test_a_card_without_jpeg_engines_says_so_and_leaves_the_engines_target_open(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_700, inprocess=12_900, alone=15_000)
    _train(out, ratio_224=0.98, jpeg=None)
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    jpeg = next(c for c in summary["targets"] if "JPEG" in c["target"])
    assert jpeg["met"] is None and jpeg["why"] == "n/a: JPEG engines: the card has no JPEG engines"
    assert "hardware JPEG engines: not read (JPEG engines: the card has no JPEG engines)" in gpu_summary.render(summary)


def test_the_card_is_named_and_the_h200s_absolute_figure_applies_on_an_h200_only(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=11_000, inprocess=11_100, alone=15_000, card="NVIDIA H100 80GB HBM3")
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    text = gpu_summary.render(summary)
    assert text.startswith("== feeder GPU check (gpu) on NVIDIA H100 80GB HBM3 (H100): ")
    assert "card: NVIDIA H100 80GB HBM3 (H100), 16 cores; DALI 2.4.0; window decoder: loads; C resize: loads" in text
    absolute = next(c for c in summary["targets"] if "12000" in c["target"])
    assert absolute["met"] is None and "n/a on H100: an H200's figure (1.1e+04)" in text
    assert next(c for c in summary["targets"] if "in-process" in c["target"])["met"] is True  # same run, same card


def test_a_gpu_run_without_the_native_decoder_says_so(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_700, inprocess=12_900, alone=15_000)
    machine = json.loads((work / "machine.json").read_text()) | {"window_decoder": "libfeeder_jpeg not built"}
    (work / "machine.json").write_text(json.dumps(machine))
    text = gpu_summary.render(gpu_summary.summarise_run(out, work, "gpu", 300))
    assert "WARNING: the native decoder or resize did not load" in text


def test_without_the_trainers_figures_the_summary_says_so(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_700, inprocess=12_900, alone=15_000)
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    assert len(summary["targets"]) == 3  # the daemon's only
    assert "trainer: no figures (see the train step's log)" in gpu_summary.render(summary)


def test_every_figure_test_and_step_is_in_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, work = _run(tmp_path, daemon=12_500, inprocess=12_600, alone=15_000)
    assert gpu_summary.main(["--out", str(out), "--work", str(work), "--budget-s", "300"]) == 1  # a step failed
    text = capsys.readouterr().out
    assert text == (out / "summary.txt").read_text()
    assert text.startswith("== feeder GPU check (gpu) on NVIDIA H200 (H200): 1 step(s) not ok, 164 s of a 300 s budget")
    assert "gpu tests: 1 failed, 1 passed, 1 skipped" in text
    assert "FAILED  tests/feeder/test_gpu_streams.py::test_slots 45.0 s  (Failed: Timeout >45.0s)" in text
    assert "PASSED  tests/transport/test_cuda_ipc.py::test_batch_arrives 1.2 s" in text
    assert " 224          15000      12600            12500       0.992           0     4800" in text
    assert "target: daemon >= 12000 images/s per GPU at 224 px (the first run, on an H200: 12,626): met (1.25e+04)" \
        in text
    assert "0.97x the in-process pipeline at 224 px: met" in text and "gpu_host_copies == 0: met (0)" in text
    assert "where the time went" not in text
    assert "gpu-tests        killed at its limit     110 / 110   killed 1 process(es) left behind: 42" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sizes"][0]["daemon_images_per_s"] == 12_500 and summary["sizes"][0]["gpu_memory_mib"] == {"0": 4800}


def test_a_missed_target_says_where_the_time_went(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=6000, inprocess=7000, alone=9000, host_copies=3)
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    assert [c["met"] for c in summary["targets"]] == [False, False, False]
    notes = " | ".join(summary["where_the_time_went"])
    assert "keeps 0.78x of the pipeline alone (9000/s)" in notes
    assert "the daemon keeps 0.86x of the in-process loader" in notes
    assert "3 batches went through host memory" in notes
    assert "NOT MET" in gpu_summary.render(summary)


def test_a_rehearsal_reports_figures_but_no_verdict_on_the_gpus_targets(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=400, inprocess=420, alone=500)
    summary = gpu_summary.summarise_run(out, work, "rehearsal", 240)
    assert [c["met"] for c in summary["targets"]] == [None, None, None]
    assert "n/a on the CPU (400)" in gpu_summary.render(summary)
    assert "n/a on the CPU (0.952)" in gpu_summary.render(summary)


def test_tests_cut_short_come_from_the_log_and_missing_figures_are_named(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_500, inprocess=12_600, alone=15_000, xml=False)
    (out / "throughput-224.json").unlink()
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    assert [(t["name"].split("::")[1], t["outcome"]) for t in summary["tests"]] == [
        ("test_batch_arrives", "passed"), ("test_slots", "failed")]
    text = gpu_summary.render(summary)
    assert "224 px throughput: no throughput-224.json (see the step's log)" in text

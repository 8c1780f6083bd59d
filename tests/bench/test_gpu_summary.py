"""The GPU check's summary, from the files its steps leave (made up here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_summary

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
         xml: bool = True) -> tuple[Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
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


def _sized(fed: float, synthetic: float, idle_fed: float, idle_synthetic: float) -> dict:
    return {"feeder_images_per_s": fed, "synthetic_images_per_s": synthetic,
            "feeder_over_synthetic": fed / synthetic, "feeder_idle_fraction": idle_fed,
            "synthetic_idle_fraction": idle_synthetic, "idle_fed_minus_synthetic": idle_fed - idle_synthetic,
            "feeder_stall_fraction": 0.01}


def _train(out: Path, ratio_224: float, idle_224: float, minutes: float) -> None:
    split = {"sizes": {"224": _sized(4685 * ratio_224, 4685, 0.01 + idle_224, 0.01),
                       "128": _sized(13_000, 13_694, 0.03, 0.01)},
             "transport": "cuda_ipc", "projected_minutes": minutes, "projection": f"projected x: {minutes} min"}
    cpu = dict(split, transport="shm", projected_minutes=20.0)
    doc = {"results": [{"throughput": {"variants": {"split": split, "cpu": cpu},
                                       "synthetic_projected_minutes": 12.2, "runs": {}}}]}
    (out / "train.json").write_text(json.dumps(doc))


def test_the_trainers_figures_and_targets_are_of_the_default_daemon(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_700, inprocess=12_900, alone=15_000)
    _train(out, ratio_224=0.98, idle_224=0.02, minutes=12.4)
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    train = {c["target"]: c["met"] for c in summary["targets"] if "trainer" in c["target"] or "idle" in c["target"]
             or "projected" in c["target"]}
    assert train == {"trainer fed >= 0.97x synthetic at 224 px": True,
                     "device idle fed minus synthetic <= 3% at 224 px": True,
                     "trainer fed >= 0.95x synthetic at 128 px": False,  # 13,000 of 13,694: 0.949x
                     "device idle fed minus synthetic <= 3% at 128 px": True,
                     "projected 8-GPU imagenet-fastai <= 12.5 min": True}
    text = gpu_summary.render(summary)
    assert "  split      224     4591      4685  0.980     3.0%     1.0%  +2.0%   1.0%  cuda_ipc" in text
    assert "  cpu        128    13000     13694  0.949" in text and "split: projected x: 12.4 min" in text
    _train(out, ratio_224=0.90, idle_224=0.05, minutes=13.0)
    missed = [c["target"] for c in gpu_summary.summarise_run(out, work, "gpu", 300)["targets"] if c["met"] is False]
    assert "trainer fed >= 0.97x synthetic at 224 px" in missed and "projected 8-GPU imagenet-fastai <= 12.5 min" \
        in missed and "device idle fed minus synthetic <= 3% at 224 px" in missed
    assert all(c["met"] is None for c in gpu_summary.summarise_run(out, work, "rehearsal", 240)["targets"])


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
    assert text.startswith("== feeder GPU check (gpu): 1 step(s) not ok, 164 s of a 300 s budget")
    assert "gpu tests: 1 failed, 1 passed, 1 skipped" in text
    assert "FAILED  tests/feeder/test_gpu_streams.py::test_slots 45.0 s  (Failed: Timeout >45.0s)" in text
    assert "PASSED  tests/transport/test_cuda_ipc.py::test_batch_arrives 1.2 s" in text
    assert " 224          15000      12600            12500       0.992           0     4800" in text
    assert "target: daemon >= 12000 images/s per GPU at 224 px: met (1.25e+04)" in text
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


def test_tests_cut_short_come_from_the_log_and_missing_figures_are_named(tmp_path: Path) -> None:
    out, work = _run(tmp_path, daemon=12_500, inprocess=12_600, alone=15_000, xml=False)
    (out / "throughput-224.json").unlink()
    summary = gpu_summary.summarise_run(out, work, "gpu", 300)
    assert [(t["name"].split("::")[1], t["outcome"]) for t in summary["tests"]] == [
        ("test_batch_arrives", "passed"), ("test_slots", "failed")]
    text = gpu_summary.render(summary)
    assert "224 px throughput: no throughput-224.json (see the step's log)" in text

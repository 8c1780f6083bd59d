"""The summary of a ``bench/gpu_check.sh`` run, from what its steps left behind.

Reads, in ``--out``, the JSON of ``bench/throughput.py`` (``throughput-224.json``) and
of ``bench/train.py`` (``train.json``, :mod:`bench.gpu_summary_train`), the JUnit XML of
the ``gpu`` tests (``gpu-tests.xml``; the test lines of ``logs.txt`` when pytest was cut
short); in ``--work`` the machine (``machine.json``, :mod:`bench.gpu_machine`: the card
and kind every figure was measured on), the steps' record (``steps.tsv``: name, status,
exit code, seconds, limit, note) and the GPU memory sampled during each step
(``gpumem-<step>.csv`` after ``gpumem-<step>.base``, nvidia-smi's ``index, MiB``). Writes
``summary.txt`` and ``summary.json`` into ``--out`` and prints the text.

Every target compares figures of this run on this card, but one: the daemon's absolute
rate at 224 px, which compares with the first run's, an H200's, and applies on an H200
only.

Example::

    python -m bench.gpu_summary --out gpu-out --work /tmp/tmp.x --mode gpu --budget-s 300
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from bench.gpu_summary_train import read_train, train_lines, train_targets

__all__ = ["SIZES_PX", "TARGET_IMAGES_PER_S", "TARGET_KIND", "TARGET_X_INPROCESS", "main", "summarise_run"]

SIZES_PX = (224,)
# Per H200 at 224 px through the daemon over CUDA IPC: MLPerf's in-process rate for
# ResNet-50 on an H200 is about 7,950 images/s per GPU; the daemon's first run gave 12,626.
# An H200's figure: the target applies on that kind of card only.
TARGET_IMAGES_PER_S = 12000.0
TARGET_KIND = "H200"
TARGET_X_INPROCESS = 0.97  # of the in-process pipeline (the daemon's code without a transport)
_DAEMONS = ("feeder-cuda-ipc", "feeder-shm")  # the daemon's row: CUDA IPC on a GPU, shm in a rehearsal
_TEST_LINE = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_MAX_TEST_LINES = 40


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(work: Path) -> list[dict[str, Any]]:
    """The steps as the script recorded them, in order."""
    steps = []
    try:
        lines = (work / "steps.tsv").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        name, status, rc, seconds, limit, note = (line.split("\t") + [""] * 6)[:6]
        steps.append({"name": name, "status": status, "rc": int(rc or 0), "seconds": int(seconds or 0),
                      "limit_s": int(limit or 0), "note": note})
    return steps


def read_tests(out: Path) -> list[dict[str, Any]]:
    """Each ``gpu`` test's outcome (``passed``, ``failed``, ``error``, ``skipped``),
    seconds and first line of its message."""
    try:
        root = ElementTree.parse(out / "gpu-tests.xml").getroot()
    except (OSError, ElementTree.ParseError):
        return _tests_from_log(out / "logs.txt")
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = next(iter((found.get("message") or found.text or "").strip().splitlines()), "")
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tests.append({"name": name, "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message[:200]})
    return tests


def _tests_from_log(log: Path) -> list[dict[str, Any]]:
    """The ``-v`` lines of a pytest that did not finish (no XML)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = [_TEST_LINE.match(line) for line in lines]
    return [{"name": m.group(1), "outcome": m.group(2).lower(), "seconds": 0.0, "message": "(from the log)"}
            for m in found if m]


def gpu_memory_mib(work: Path, step: str) -> dict[str, int] | None:
    """Peak GPU memory used during ``step`` above what was used before it, MiB per GPU
    (every process's); None without samples (no nvidia-smi)."""
    def read(path: Path) -> dict[str, list[int]]:
        values: dict[str, list[int]] = {}
        try:
            for line in path.read_text().splitlines():
                index, _, used = line.partition(",")
                if used.strip().isdigit():
                    values.setdefault(index.strip(), []).append(int(used))
        except OSError:
            pass
        return values

    samples, base = read(work / f"gpumem-{step}.csv"), read(work / f"gpumem-{step}.base")
    if not samples:
        return None
    return {gpu: max(used) - min(base.get(gpu, [0])) for gpu, used in samples.items()}


def _rows(doc: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {row["loader"]: row for row in (doc or {}).get("results", [])}


def _size_figures(out: Path, work: Path, px: int) -> dict[str, Any]:
    """Images/s per GPU at ``px`` of the in-process pipeline and of the daemon."""
    doc = _json(out / f"throughput-{px}.json")
    rows = _rows(doc)
    daemon_name = next((n for n in _DAEMONS if n in rows), _DAEMONS[0])
    daemon, inprocess = rows.get(daemon_name, {}), rows.get("inprocess", {})
    alone = _json(out / f"pipeline-{px}.json") or {}
    figures: dict[str, Any] = {
        "image_size_px": px, "daemon_loader": daemon_name,
        "pipeline_alone_images_per_s": alone.get("median_images_per_s"),
        "inprocess_images_per_s": inprocess.get("images_per_s"),
        "daemon_images_per_s": daemon.get("images_per_s"),
        "x_inprocess": daemon.get("x_inprocess"),
        "gpu_host_copies": (daemon.get("daemon") or {}).get("gpu_host_copies"),
        "gpu_batches": (daemon.get("daemon") or {}).get("gpu_batches"),
        "daemon_cpus_busy": daemon.get("cpus_busy"), "inprocess_cpus_busy": inprocess.get("cpus_busy"),
        "threads": (doc or {}).get("config", {}).get("threads"),
        "batch_size": (doc or {}).get("config", {}).get("batch_size"),
        "gpu_memory_mib": gpu_memory_mib(work, f"throughput-{px}"),
        "errors": {name: row.get("error") or row.get("skipped") for name, row in rows.items()
                   if row.get("error") or row.get("skipped")},
    }
    if doc is None:
        figures["errors"] = {"throughput": f"no throughput-{px}.json (see the step's log)"}
    return figures


def _where_the_time_went(fig: dict[str, Any]) -> list[str]:
    """Why the daemon's rate at this size is what it is: the stage that lost most."""
    notes = []
    alone, inproc, daemon = (fig["pipeline_alone_images_per_s"], fig["inprocess_images_per_s"],
                             fig["daemon_images_per_s"])
    if alone and inproc:
        notes.append(f"the in-process loader keeps {inproc / alone:.2f}x of the pipeline alone ({alone:.0f}/s): "
                     "the rest is the producer, reads and queue")
    if inproc and daemon:
        notes.append(f"the daemon keeps {daemon / inproc:.2f}x of the in-process loader: the rest is the "
                     "transport, gRPC and the client")
    threads = fig["threads"]
    for who in ("daemon", "inprocess"):
        busy = fig[f"{who}_cpus_busy"]
        if busy and threads and busy >= 0.85 * threads:
            notes.append(f"{who}: {busy:.1f} of its {threads} CPUs busy: CPU-bound (more --threads, or less CPU "
                         "work per image)")
    if fig["gpu_host_copies"]:
        notes.append(f"{fig['gpu_host_copies']} batches went through host memory (expected 0)")
    return notes


def targets(fig: dict[str, Any], mode: str, kind: str) -> list[dict[str, Any]]:
    """The GPU check's targets at 224 px on a card of ``kind`` (figures only in a
    rehearsal on the CPU)."""
    daemon, ratio, copies = fig["daemon_images_per_s"], fig["x_inprocess"], fig["gpu_host_copies"]
    checks = [
        {"target": f"daemon >= {TARGET_X_INPROCESS:.2f}x the in-process pipeline at 224 px", "value": ratio,
         "met": ratio is not None and ratio >= TARGET_X_INPROCESS},
        {"target": "gpu_host_copies == 0", "value": copies, "met": copies == 0},
        {"target": f"daemon >= {TARGET_IMAGES_PER_S:.0f} images/s per GPU at 224 px (the first run, on an "
                   f"{TARGET_KIND}: 12,626)", "value": daemon,
         "met": daemon is not None and daemon >= TARGET_IMAGES_PER_S},
    ]
    if kind != TARGET_KIND:
        checks[-1] |= {"met": None, "why": f"n/a on {kind}: an {TARGET_KIND}'s figure"}
    if mode != "gpu":
        for check in checks:
            check["met"], check["why"] = None, "n/a on the CPU"  # a CPU rehearsal: the GPU's targets do not apply
    return checks


def read_machine(work: Path) -> dict[str, Any]:
    """What the machine step found (``machine.json``; empty where it did not run)."""
    return _json(work / "machine.json") or {}


def _machine_lines(machine: dict[str, Any], mode: str) -> list[str]:
    if not machine:
        return ["machine: no description (see the machine step's log)"]
    dali = (machine.get("packages") or {}).get("nvidia.dali", "?").split(" from ")[0]
    lines = [f"card: {machine.get('card')} ({machine.get('kind')}), {machine.get('cores')} cores; DALI {dali}; "
             f"window decoder: {machine.get('window_decoder')}; C resize: {machine.get('c_resize')}; "
             f"JPEG engines (NVML): {machine.get('jpeg_engines')}"]
    if mode == "gpu" and (machine.get("window_decoder"), machine.get("c_resize")) != ("loads", "loads"):
        lines.append("WARNING: the native decoder or resize did not load: the split and CPU daemons ran without "
                     "them (a rerun without --site-parts and nothing unpacked in $SITE?)")
    return lines


def summarise_run(out: Path, work: Path, mode: str, budget_s: int) -> dict[str, Any]:
    """Everything the summary says, as JSON-able data."""
    steps, tests, machine = read_steps(work), read_tests(out), read_machine(work)
    sizes = [_size_figures(out, work, px) for px in SIZES_PX]
    train = read_train(out)
    kind = machine.get("kind") or "an unknown card"
    checks = targets(sizes[0], mode, kind) + train_targets(train, mode)
    missed = any(c["met"] is False for c in checks)
    return {
        "mode": mode, "budget_s": budget_s, "seconds": sum(s["seconds"] for s in steps), "steps": steps,
        "machine": machine, "card": machine.get("card", "?"), "kind": kind,
        "tests": tests, "sizes": sizes, "train": {k: v for k, v in train.items() if k != "windows"},
        "train_gpu_memory_mib": gpu_memory_mib(work, "train"), "targets": checks,
        "where_the_time_went": _where_the_time_went(sizes[0]) if missed or mode != "gpu" else [],
    }


def _fmt(value: Any, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _test_lines(tests: list[dict[str, Any]]) -> list[str]:
    counts: dict[str, int] = {}
    for test in tests:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    head = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "none ran"
    lines = [f"gpu tests: {head}"]
    for test in tests[:_MAX_TEST_LINES]:
        message = f"  ({test['message']})" if test["message"] and test["outcome"] != "passed" else ""
        lines.append(f"  {test['outcome'].upper():7} {test['name']} {test['seconds']:.1f} s{message}")
    if len(tests) > _MAX_TEST_LINES:
        lines.append(f"  ... and {len(tests) - _MAX_TEST_LINES} more (gpu-tests.xml)")
    return lines


def _figure_lines(sizes: list[dict[str, Any]]) -> list[str]:
    first = sizes[0]
    lines = [f"images/s per GPU (batch {first['batch_size'] or '?'}, "
             f"{first['threads'] or '?'} CPU threads per loader):",
             f"  {'px':>4} {'pipeline alone':>14} {'inprocess':>10} {first['daemon_loader']:>16} "
             f"{'x inprocess':>11} {'host copies':>11} {'GPU MiB':>8}"]
    for fig in sizes:
        memory = fig["gpu_memory_mib"]
        lines.append(f"  {fig['image_size_px']:>4} {_fmt(fig['pipeline_alone_images_per_s']):>14} "
                     f"{_fmt(fig['inprocess_images_per_s']):>10} {_fmt(fig['daemon_images_per_s']):>16} "
                     f"{_fmt(fig['x_inprocess'], '.3f'):>11} {_fmt(fig['gpu_host_copies'], 'd'):>11} "
                     f"{_fmt(max(memory.values()) if memory else None, 'd'):>8}")
        lines += [f"  {fig['image_size_px']} px {name}: {error}" for name, error in fig["errors"].items()]
    return lines


def render(summary: dict[str, Any]) -> str:
    """The summary as text: verdict, tests, figures, targets, steps."""
    steps = summary["steps"]
    bad = [s for s in steps if s["status"] != "ok"]
    verdict = "ok" if not bad else f"{len(bad)} step(s) not ok"
    lines = [f"== feeder GPU check ({summary['mode']}) on {summary.get('card', '?')} ({summary.get('kind', '?')}): "
             f"{verdict}, {summary['seconds']} s of a {summary['budget_s']} s budget"]
    lines += _machine_lines(summary.get("machine") or {}, summary["mode"])
    lines += _test_lines(summary["tests"]) + _figure_lines(summary["sizes"])
    lines.append("GPU MiB: peak device memory used during the throughput step, all processes, above its start")
    lines += train_lines(summary.get("train") or {})
    for check in summary["targets"]:
        met = "met" if check["met"] else "NOT MET" if check["met"] is False else check.get("why") or "n/a"
        lines.append(f"target: {check['target']}: {met} ({_fmt(check['value'], '.3g')})")
    lines += [f"  where the time went: {note}" for note in summary["where_the_time_went"]]
    lines.append("steps (seconds / limit):")
    for step in steps:
        note = f"  {step['note']}" if step["note"] else ""
        lines.append(f"  {step['name']:<16} {step['status']:<22} {step['seconds']:>4} / {step['limit_s']:<4}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Writes and prints the summary; 0 when every step was ok."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the check's $OUT")
    parser.add_argument("--work", type=Path, required=True, help="the check's work folder (steps.tsv)")
    parser.add_argument("--mode", choices=("gpu", "rehearsal"), default="gpu")
    parser.add_argument("--budget-s", type=int, default=300)
    args = parser.parse_args(argv)
    summary = summarise_run(args.out, args.work, args.mode, args.budget_s)
    text = render(summary)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0 if all(s["status"] == "ok" for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())

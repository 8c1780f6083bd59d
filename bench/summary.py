"""From the windows each loader's consumers measured to one row per loader.

Every figure is a median over the ``repeats`` windows. With several consumers the
windows of repeat ``k`` are added up (they run at the same time, lined up by a
barrier); CPU seconds per image divide the tree's CPU rate by that aggregate rate.
With epoch windows (``throughput.py --epochs``) the first epoch is reported apart
(``epoch1_*``) and ``images_per_s`` / ``cpu_s_per_image`` are the later epochs'.
"""

from __future__ import annotations

from statistics import mean, median
from typing import Any

__all__ = [
    "FEEDER_TARGETS", "RATIO_PEERS", "STORE_PEERS", "STORE_TARGETS", "add_ratios", "add_store_ratios",
    "check_store_targets", "check_targets", "merge_results", "summarise", "summarise_runs",
]

# Column name -> loader every row is divided by (ratios are to peers in the same run).
RATIO_PEERS = {"x_inprocess": "inprocess", "x_tfdata": "tfdata", "x_torchvision": "torchvision",
               "x_decode_only": "decode-only"}
# What feeder through its daemon (same host: shared memory) aims for on CPU at 224 px,
# as a fraction of each peer's images/s: its own pipeline run in-process (the cost of
# the transport), tf.data in-process (the strongest CPU peer) and torchvision.
FEEDER_TARGETS = {"inprocess": 0.97, "tfdata": 1.25, "torchvision": 2.0}
_FEEDER = "feeder-shm"
# --store s3: the loaders a user would pick for an object store, and feeder from it.
STORE_PEERS = ("streaming", "webdataset-s3", "litdata")
_FEEDER_STORE = "feeder-s3"
# What feeder from the store aims for (one run, the server on the same machine):
# (name, feeder-s3's figure, the reference, ratio). "local" is feeder-shm's later
# epochs from local disk; "best peer epoch 1" the best of STORE_PEERS' first epochs.
STORE_TARGETS = (
    ("epoch 2 (node cache) vs feeder-shm from local disk", "images_per_s", "local", 0.97),
    ("epoch 1 (cold) vs the best peer's epoch 1", "epoch1_images_per_s", "best peer epoch 1", 1.5),
    ("epoch 1 (cold) vs feeder-shm from local disk", "epoch1_images_per_s", "local", 0.8),
)


def _rate(window: dict) -> float:
    return window["images"] / window["duration_s"] if window["duration_s"] > 0 else 0.0


def _per_repeat(clients: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Aggregate images/s, CPU s/image and CPU s/s (CPUs kept busy) for each repeat."""
    repeats = min(len(c["windows"]) for c in clients)
    rates, cpu, busy = [], [], []
    for k in range(repeats):
        windows = [c["windows"][k] for c in clients]
        total = sum(_rate(w) for w in windows)
        cpu_per_s = mean(w["cpu_s"] / w["duration_s"] for w in windows if w["duration_s"] > 0)
        rates.append(total)
        cpu.append(cpu_per_s / total if total > 0 else float("nan"))
        busy.append(cpu_per_s)
    return rates, cpu, busy


def _epoch_figures(clients: list[dict], rates: list[float], cpu: list[float]) -> dict[str, Any]:
    """First-epoch and later-epoch medians, when the windows are epochs."""
    flags = [w.get("first_epoch", False) for w in clients[0]["windows"]][: len(rates)]
    if not any(flags):
        return {}
    first = [k for k, flag in enumerate(flags) if flag]
    later = [k for k, flag in enumerate(flags) if not flag]
    figures = {"epoch1_images_per_s": median(rates[k] for k in first),
               "epoch1_cpu_s_per_image": median(cpu[k] for k in first)}
    if later:
        figures.update(images_per_s=median(rates[k] for k in later), cpu_s_per_image=median(cpu[k] for k in later))
    return figures


def _client_figures(clients: list[dict]) -> dict[str, Any]:
    per_client = [median(_rate(w) for w in c["windows"]) for c in clients]
    spread = (max(per_client) - min(per_client)) / mean(per_client) if mean(per_client) > 0 else 0.0
    return {"per_client_images_per_s": per_client, "client_spread": spread}


def summarise(result: dict, memory: dict[str, int]) -> dict[str, Any]:
    """One table row from a worker's result and the memory its process tree peaked at.

    Args:
        result: what ``bench.worker.run`` returned (or ``{"loader", "error"}``).
        memory: ``{"peak_pss_bytes", "peak_rss_bytes"}`` of the loader's process tree.

    Returns:
        A JSON-able row; ``error`` is set (and figures are absent) if the loader failed.
    """
    row: dict[str, Any] = {"loader": result["loader"], **memory}
    if "skipped" in result:
        return {**row, "skipped": result["skipped"]}
    failed = [c for c in result.get("clients", []) if "error" in c or not c["windows"]]
    if "error" in result or failed:
        row["error"] = result.get("error") or "; ".join(c.get("error", "no complete window") for c in failed)
        return row
    clients = result["clients"]
    rates, cpu, busy = _per_repeat(clients)
    row.update(
        images_per_s=median(rates),
        images_per_s_repeats=rates,
        cpu_s_per_image=median(cpu),
        cpus_busy=median(busy),
        setup_s=max(c["setup_s"] for c in clients),
        batches=sum(c["batches"] for c in clients),
        problems=sorted({p for c in clients for p in c["problems"]}),
        cpus=result["cpus"],
        clients=len(clients),
        **_client_figures(clients),
    )
    row.update(_epoch_figures(clients, rates, cpu))
    if "daemon" in result:  # how the daemon made its batches (gpu_host_copies, ...)
        row["daemon"] = result["daemon"]
    return row


def merge_results(results: list[dict]) -> dict:
    """One worker result from several starts of the same loader: each consumer's
    windows one after another (the first failure, if any, instead)."""
    failed = [r for r in results if "error" in r or "skipped" in r or any("error" in c for c in r["clients"])]
    if failed:
        return failed[0]
    merged = []
    for rank, group in enumerate(zip(*(r["clients"] for r in results))):
        merged.append({
            "rank": rank,
            "setup_s": max(c["setup_s"] for c in group),
            "batches": sum(c["batches"] for c in group),
            "problems": sorted({p for c in group for p in c["problems"]}),
            "windows": [w for c in group for w in c["windows"]],
        })
    merged_result = {"loader": results[0]["loader"], "cpus": results[0]["cpus"], "clients": merged}
    if all("daemon" in r for r in results):  # one daemon per start: their counters add up
        merged_result["daemon"] = {k: sum(r["daemon"][k] for r in results) for k in results[0]["daemon"]}
    return merged_result


def summarise_runs(runs: list[dict]) -> dict[str, Any]:
    """One table row from every start of one loader (see ``throughput.run_loader``)."""
    memory = {key: max(r["memory"][key] for r in runs) for key in runs[0]["memory"]}
    row = summarise(merge_results([r["result"] for r in runs]), memory)
    row["load_average_1m"] = max(r["load_average_1m"] for r in runs)
    row["starts"] = len(runs)
    return row


def add_ratios(rows: list[dict]) -> None:
    """Sets ``x_<peer>`` on every measured row: its images/s over the peer's."""
    rates = {r["loader"]: r.get("images_per_s") for r in rows}
    for row in rows:
        for column, peer in RATIO_PEERS.items():
            mine, theirs = row.get("images_per_s"), rates.get(peer)
            row[column] = mine / theirs if mine is not None and theirs else None


def check_targets(rows: list[dict]) -> list[dict]:
    """feeder-shm against each target whose peer was measured in this run.

    Returns:
        ``[{"peer", "ratio", "target_images_per_s", "achieved_ratio", "met"}]``; empty
        when feeder-shm did not run or failed.
    """
    rates = {r["loader"]: r.get("images_per_s") for r in rows}
    mine = rates.get(_FEEDER)
    if not mine:
        return []
    checks = []
    for peer, ratio in FEEDER_TARGETS.items():
        theirs = rates.get(peer)
        if theirs:
            checks.append(
                {"peer": peer, "ratio": ratio, "target_images_per_s": ratio * theirs,
                 "achieved_ratio": mine / theirs, "met": mine >= ratio * theirs}
            )
    return checks


def _store_references(rows: list[dict]) -> dict[str, float | None]:
    by_name = {r["loader"]: r for r in rows}
    peers = [by_name[p].get("epoch1_images_per_s") for p in STORE_PEERS if p in by_name]
    measured = [rate for rate in peers if rate]
    return {"local": by_name.get(_FEEDER, {}).get("images_per_s"),
            "best peer epoch 1": max(measured) if measured else None}


def add_store_ratios(rows: list[dict]) -> None:
    """Sets, on every measured row of a ``--store s3`` run, ``x_local`` and
    ``epoch1_x_local`` (its later and first epochs over feeder-shm's later epochs from
    local disk) and ``epoch1_x_best_peer`` (its first epoch over the best first epoch
    of ``STORE_PEERS``)."""
    references = _store_references(rows)
    local, best = references["local"], references["best peer epoch 1"]
    for row in rows:
        later, first = row.get("images_per_s"), row.get("epoch1_images_per_s")
        row["x_local"] = later / local if later and local else None
        row["epoch1_x_local"] = first / local if first and local else None
        row["epoch1_x_best_peer"] = first / best if first and best else None


def check_store_targets(rows: list[dict]) -> list[dict]:
    """feeder-s3 against ``STORE_TARGETS`` whose reference was measured in this run.

    Returns:
        ``[{"peer", "ratio", "target_images_per_s", "achieved_ratio", "met"}]`` (``peer``
        names the target); empty when feeder-s3 did not run or failed.
    """
    mine = next((r for r in rows if r["loader"] == _FEEDER_STORE and "images_per_s" in r), None)
    if mine is None:
        return []
    references = _store_references(rows)
    checks = []
    for name, figure, reference, ratio in STORE_TARGETS:
        theirs, achieved = references[reference], mine.get(figure)
        if theirs and achieved:
            checks.append({"peer": name, "ratio": ratio, "target_images_per_s": ratio * theirs,
                           "achieved_ratio": achieved / theirs, "met": achieved >= ratio * theirs})
    return checks

"""Runs one loader in its own process: ``python -m bench.worker REQUEST.json RESULT.json``.

Each loader gets a fresh process (and the CPUs of its budget) so that memory, threads
and caches of one loader never help or hurt the next. With ``clients > 1`` a
multi-client loader's shared part (the daemon) starts once here and each consumer runs
in a process of its own, as the local ranks of a training job would. A request whose
``step`` is ``prepare`` runs the loader module's ``prepare(spec)`` instead (a dataset
file in its own format, written once before its first start).

This module and those it imports use the standard library only: the worker of a
loader with a virtual environment of its own (``bench/venvs.py``) runs in that one.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import traceback
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path

from bench.loaders import MULTI_CLIENT, LoaderSpec, LoaderUnavailable, loader_module
from bench.measure import Schedule, consume

__all__ = ["STEPS", "main", "prepare", "request_for", "restrict_cpus"]

# What a worker does: measure the loader, or run its module's ``prepare`` (once, before).
STEPS = ("measure", "prepare")


def request_for(name: str, spec: LoaderSpec, schedule: Schedule, step: str = "measure") -> dict:
    """The JSON-able request ``main`` reads.

    Raises:
        ValueError: ``step`` is not one of ``STEPS``.
    """
    if step not in STEPS:
        raise ValueError(f"step must be one of {STEPS}, got {step!r}")
    spec_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items()}
    return {"loader": name, "spec": spec_dict, "schedule": asdict(schedule), "step": step}


def restrict_cpus(threads: int) -> list[int]:
    """Pins this process (and all it starts) to ``threads`` of its allowed CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[: max(1, min(threads, len(allowed)))]
    os.sched_setaffinity(0, chosen)
    return chosen


def _shared(name: str, spec: LoaderSpec) -> AbstractContextManager:
    opener = getattr(loader_module(name), "open_shared", None)
    return opener(spec) if opener is not None else nullcontext(None)


def _client(name: str, spec: LoaderSpec, schedule: Schedule, root: int, shared: object, barrier, queue) -> None:
    try:
        queue.put(consume(name, spec, schedule, root, shared, barrier))
    except Exception as e:  # reported to the parent, which names the failing client
        barrier.abort()
        queue.put({"rank": spec.client_rank, "error": f"{type(e).__name__}: {e}"})


def _run_clients(name: str, spec: LoaderSpec, schedule: Schedule, shared: object) -> list[dict]:
    context = mp.get_context("spawn")
    barrier, queue = context.Barrier(spec.clients), context.Queue()
    ranks = [LoaderSpec(**{**asdict(spec), "client_rank": r}) for r in range(spec.clients)]
    args = [(name, s, schedule, os.getpid(), shared, barrier, queue) for s in ranks]
    processes = [context.Process(target=_client, args=a, daemon=True) for a in args]
    for p in processes:
        p.start()
    results = sorted((queue.get() for _ in processes), key=lambda r: r["rank"])
    for p in processes:
        p.join()
    return results


def run(name: str, spec: LoaderSpec, schedule: Schedule) -> dict:
    """Measures loader ``name``; returns ``{"loader", "cpus", "clients": [per consumer]}``."""
    loader_module(name)  # imported before pinning: a slow import is setup, not budget
    cpus = restrict_cpus(spec.threads)
    with _shared(name, spec) as shared:
        if spec.clients > 1 and name in MULTI_CLIENT:
            clients = _run_clients(name, spec, schedule, shared)
        else:
            clients = [consume(name, spec, schedule, os.getpid(), shared)]
    return {"loader": name, "cpus": cpus, "clients": clients}


def prepare(name: str, spec: LoaderSpec) -> dict:
    """Runs loader ``name``'s ``prepare(spec)``; returns ``{"loader", "prepared": True}``.

    Raises:
        AttributeError: the loader's module has no ``prepare``.
    """
    loader_module(name).prepare(spec)
    return {"loader": name, "prepared": True}


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    spec, schedule = LoaderSpec(**request["spec"]), Schedule(**request["schedule"])
    try:
        if request.get("step", "measure") == "prepare":
            result = prepare(request["loader"], spec)
        else:
            result = run(request["loader"], spec, schedule)
    except LoaderUnavailable as e:
        print(f"{request['loader']}: skipped: {e}", file=sys.stderr)
        result = {"loader": request["loader"], "skipped": str(e)}
    except Exception as e:  # one failing loader must not stop the others
        traceback.print_exc()
        result = {"loader": request["loader"], "error": f"{type(e).__name__}: {e}"}
    Path(argv[1]).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

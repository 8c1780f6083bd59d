"""One rank of the trainer bench (``bench/train.py`` runs it under torchrun): the
bundled trainer's own model, optimiser and step (:class:`trainer.loop.Trainer`), fed
in turn by each source of a plan, timed over steady windows.

Every source keeps a loader of its own: the daemon variants a ``FeederLoader`` each,
and synthetic tensors made on the device. Per image size, each source first runs
``warmup_steps`` untimed (streams opening, DALI building its pipeline, the split
decoder tuning its CPU share, the kernels choosing their algorithms); then, repeat
after repeat in an order turned around each repeat, each source runs
``settle_steps`` and a timed window of ``window_steps`` (both scaled by pixel count
at smaller sizes, so that windows last about as long). No validation or checkpoint
runs inside a window.

A daemon works ahead of its consumer up to its ring's and the loader's prefetch
depth. Were its stream kept open while the other sources run, it would fill them, and
its next window would begin with a store of ready batches: a daemon slower than the
step would read as fast as it for as many steps. So a source's stream is dropped as
its window ends (the loader keeps its position) and opened again by the settle steps
of its next window: the ring starts empty, and a slower daemon's consumer waits from
the first batches on, as it would in a long run. Dropping it also stops the daemon,
so it takes nothing from the next source's window.

Rank 0 writes the document (:mod:`bench.train_figures`) after every window, so a
run cut short keeps the windows that finished.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.nvml import WindowSampler, open_reader
from bench.train_figures import SYNTHETIC, Window, summarise
from bench.train_plan import SteadyPlan
from clients import FeederLoader, SyntheticLoader
from clients.idle import StepGaps
from trainer.config import TrainConfig
from trainer.data import make_loaders
from trainer.distributed import Dist, all_reduce_max, init_distributed, shutdown_distributed
from trainer.loop import Trainer, _step_stream

__all__ = ["Feed", "main"]


class Feed:
    """One source's batches, pass after pass, and its stream dropped on demand."""

    def __init__(self, name: str, loader: FeederLoader | SyntheticLoader) -> None:
        self.name, self.loader = name, loader
        self._batches: Any = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch (a new pass at an epoch's end: the stream runs on across epochs)."""
        while True:
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                batch = next(self._batches)
                return batch[0], batch[1]
            except StopIteration:
                self._batches = None

    def resize(self, batch_size: int, image_size: int) -> None:
        self.loader.set_batch_size(batch_size)
        self.loader.set_image_size(image_size)

    def drop_stream(self) -> None:
        """Ends the daemon's stream, the loader staying where it is: loading its own
        state drops the stream; the next batch opens a new one at the cursor."""
        if isinstance(self.loader, FeederLoader):
            self.loader.load_state_dict(self.loader.state_dict())
            self._batches = None

    @property
    def transport(self) -> str:
        return getattr(self.loader, "transport", "")


class _Bench:
    """The trainer, its sources, and the windows measured so far."""

    def __init__(self, plan: SteadyPlan, dist: Dist) -> None:
        self.plan, self.dist = plan, dist
        names = list(plan.sources)
        config = TrainConfig(server=plan.sources[names[0]], dataset=plan.dataset, schedule=plan.schedule,
                             arch=plan.arch, data="feeder", val_every_epochs=0, out_dir=Path(plan.out_dir),
                             log_every_steps=0, seed=plan.seed, prefetch_batches=plan.prefetch_batches)
        self.trainer = Trainer(config, dist)  # its train loader is the first daemon's
        phase = self.trainer.schedule.phases[0]
        for group in self.trainer.optimizer.param_groups:
            group["lr"], group["momentum"] = phase.lr_start, phase.momentum
        self.feeds = {SYNTHETIC: Feed(SYNTHETIC, make_loaders(replace(config, data="synthetic"), dist, phase,
                                                              self.trainer.amp_dtype)[0]),
                      names[0]: Feed(names[0], self.trainer.train_loader)}
        for name in names[1:]:
            loader = make_loaders(replace(config, server=plan.sources[name]), dist, phase, self.trainer.amp_dtype)[0]
            self.feeds[name] = Feed(name, loader)
        self.windows: list[Window] = []
        self.counters = WindowSampler(None, "the trainer runs on the CPU")
        if dist.device.type == "cuda" and dist.is_main:
            uuid = f"GPU-{torch.cuda.get_device_properties(dist.device).uuid}"
            self.counters = WindowSampler(*open_reader(uuid, dist.device.index or 0))

    def run(self) -> None:
        for size in self.plan.sizes:
            settle, steps = self.plan.steps_at(size)
            for name, feed in self.feeds.items():
                feed.resize(self.plan.batch_size, size)
                self._steps(feed, settle if name == SYNTHETIC else self.plan.warmup_steps)  # no stream to warm
                feed.drop_stream()
            order = list(self.feeds)
            for repeat in range(self.plan.repeats):
                for name in order if repeat % 2 == 0 else order[::-1]:
                    feed = self.feeds[name]
                    time.sleep(self.plan.pause_s)
                    self._steps(feed, settle)
                    self.windows.append(self._window(feed, size, repeat, steps))
                    feed.drop_stream()
                    self._write(complete=False)
        self._write(complete=True)

    def _steps(self, feed: Feed, steps: int) -> None:
        for _ in range(steps):
            self.trainer._step(*feed.next())  # the trainer's own step: forward, loss, backward, optimiser

    def _window(self, feed: Feed, size: int, repeat: int, steps: int) -> Window:
        device, loader = self.dist.device, feed.loader
        gaps, waited = StepGaps(device), loader.wait_seconds
        _synchronize(device)
        self.counters.start()
        started = time.perf_counter()
        images = 0
        for _ in range(steps):
            batch = feed.next()
            gaps.started()
            self.trainer._step(*batch)
            gaps.ended()
            images += len(batch[1])
        _synchronize(device)
        seconds = time.perf_counter() - started
        counters = self.counters.stop()
        seconds = all_reduce_max([seconds], device)[0]
        return Window(feed.name, size, repeat, steps, images, seconds, gaps.share().fraction,
                      (loader.wait_seconds - waited) / seconds, counters.gpu_percent, counters.jpeg_percent,
                      counters.reason or counters.source, feed.transport)

    def _write(self, complete: bool) -> None:
        if not self.dist.is_main:
            return
        figures = summarise(self.windows, [n for n in self.feeds if n != SYNTHETIC], self.plan.cores)
        document = self.plan.document | {"results": [{"throughput": figures | {"complete": complete}}]}
        path = Path(self.plan.json)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(partial, path)  # whole or not at all: a kill between windows leaves the last one

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.loader.close()
        self.trainer.close()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    """Runs the plan given by ``--plan`` on this rank."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, required=True, help="the plan's JSON (bench/train.py writes it)")
    plan = SteadyPlan.read(parser.parse_args(argv).plan)
    dist = init_distributed("auto")
    try:
        with _step_stream(dist.device, "high"):
            bench = _Bench(plan, dist)
            try:
                bench.run()
            finally:
                bench.close()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()

"""The bundled trainer: DDP ResNet on feeder batches, phase schedules, AMP,
time-to-accuracy, mid-epoch checkpoints. It uses only the loader's public API."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from clients import merge_states
from clients.idle import StepGaps
from trainer.accuracy import EpochPart, EpochRecord, MetricsLog, plot_records
from trainer.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from trainer.config import TrainConfig
from trainer.data import make_loaders
from trainer.distributed import (
    Dist,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    init_distributed,
    shutdown_distributed,
)
from trainer.evaluate import Evaluation, evaluate
from trainer.model import build_model, build_optimizer
from trainer.schedule import load_schedule
from trainer.stop import Stopped, StopRequests

__all__ = ["Trainer", "train"]


def train(config: TrainConfig) -> dict[str, Any]:
    """Runs training as configured, in this process (one rank of a torchrun job, or
    alone). Returns the summary that is also written to ``out_dir/summary.json``."""
    dist = init_distributed(config.device)
    try:
        with _step_stream(dist.device, config.step_priority):
            trainer = Trainer(config, dist)
            try:
                with StopRequests(dist.device, dist.control) as stops:
                    trainer.stops = stops
                    return trainer.run()
            finally:
                trainer.close()
    finally:
        shutdown_distributed()


def _step_stream(device: torch.device, priority: str) -> contextlib.AbstractContextManager:
    """Where the steps' kernels go: on CUDA with ``high`` priority, a stream of the
    highest priority CUDA has, so the block scheduler runs them before the input
    pipeline's (the daemon's copies and DALI's kernels run at the lowest); the
    loader's conversion of a CUDA IPC batch runs there too, in order before the step
    (a batch from host memory is copied and converted on the loader's side stream,
    which the step stream then waits for)."""
    if device.type != "cuda" or priority != "high":
        return contextlib.nullcontext()
    _, highest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a static method
    return torch.cuda.stream(torch.cuda.Stream(device, priority=highest))


def _precision(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32."""
    if config.precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision]


@dataclass
class _Running:
    """This rank's figures of the epoch whose steps are running."""

    epoch: int
    wait_before: float  # the loader's wait_seconds at the epoch's start
    loss_sum: torch.Tensor  # on the device: read back only for a line or a checkpoint
    images: int = 0
    started: float = field(default_factory=time.perf_counter)


class Trainer:
    """One rank's training run; see ``TrainConfig`` for what it does."""

    def __init__(self, config: TrainConfig, dist: Dist) -> None:
        self.config, self.dist = config, dist
        self.schedule = load_schedule(config.schedule)
        self.total_epochs = config.epochs or self.schedule.total_epochs
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        first = self.schedule.phases[0]
        self.amp_dtype = _precision(config, dist.device)
        # The loader normalises straight into the autocast dtype: no conversion in the first layer.
        self.train_loader, self.val_loader, classes = make_loaders(config, dist, first, self.amp_dtype)
        self.gaps = StepGaps(dist.device)
        for start, phase in self.schedule.phase_starts()[1:]:  # the loader opens each phase's stream ahead
            self.train_loader.plan_sizes(start, phase.batch_size, phase.image_size, phase.min_scale)
        self.model = build_model(config.arch, classes, dist.device)
        self.net: torch.nn.Module = self.model
        if dist.world_size > 1:
            ids = [dist.device.index] if dist.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=ids,
                                               gradient_as_bucket_view=True)
        self.optimizer = build_optimizer(self.model, self.schedule.weight_decay)
        self.scaler = torch.amp.GradScaler(dist.device.type,
                                           enabled=self.amp_dtype == torch.float16)
        self.log = MetricsLog(config.out_dir / "metrics.csv", write=dist.is_main)
        self.epoch = self.step = 0
        self.elapsed_s = 0.0
        self.time_to_target_s: float | None = None
        self.visits: Counter[str] = Counter()
        self.stops: StopRequests | None = None  # SIGTERM noted while training (see train())
        self._running: _Running | None = None  # while an epoch's steps run
        self._carried: EpochPart | None = None  # the resumed epoch's steps before the checkpoint
        if config.resume and latest_checkpoint(config.checkpoints) is not None:
            self._restore()

    # -- helpers ---------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.amp_dtype)

    def _say(self, line: str) -> None:
        if self.dist.is_main:
            print(line, flush=True)

    def _set_hyper(self, lr: float, momentum: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"], group["momentum"] = lr, momentum

    # -- the run ---------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Trains through the schedule (or to the target); returns the summary."""
        self._say(f"training {self.config.arch} on {self.config.data} data, "
                  f"{self.dist.world_size} rank(s) on {self.dist.device}, "
                  f"{self.total_epochs} epochs, precision "
                  f"{self.amp_dtype or torch.float32}".replace("torch.", ""))
        started = time.perf_counter() - self.elapsed_s
        while self.epoch < self.total_epochs:
            record = self._run_epoch(self.epoch, started)
            self.log.append(record)
            self._say(record.line())
            self.epoch += 1
            if not self.config.checkpoint_every_steps:  # at epoch ends only
                self.elapsed_s = record.wall_s
                self._checkpoint()
            if self._reached(record):
                self.time_to_target_s = record.wall_s
                self._say(f"target reached after {record.wall_s:.1f} s (epoch {record.epoch})")
                break
        return self._finish()

    def _run_epoch(self, epoch: int, started: float) -> EpochRecord:
        index = self.schedule.phase_index(epoch)
        phase = self.schedule.phases[index]
        loader = self.train_loader
        loader.set_epoch(epoch)
        loader.set_batch_size(phase.batch_size)
        loader.set_image_size(phase.image_size)
        loader.set_min_scale(phase.min_scale)
        part = self._train_epoch(epoch, phase.momentum, started)
        self._carried = None  # in part now
        evaluation = self._validate(epoch, phase)
        return EpochRecord(
            epoch=epoch, phase=index, image_size=phase.image_size, batch_size=phase.batch_size,
            lr=self.optimizer.param_groups[0]["lr"], momentum=phase.momentum, **part.figures,
            val_loss=evaluation.loss, val_top1=evaluation.top1, val_top5=evaluation.top5,
            val_images=evaluation.images, wall_s=time.perf_counter() - started,
        )

    def _train_epoch(self, epoch: int, momentum: float, started: float) -> EpochPart:
        loader, config = self.train_loader, self.config
        self.net.train()
        self.gaps.reset()
        running = self._running = _Running(epoch, loader.wait_seconds, torch.zeros((), device=self.dist.device))
        steps = 0
        progress = loader.epoch_progress  # of the whole job: the schedule follows samples seen, not steps
        # Done already: resumed after its last step, which the checkpoint holds.
        for batch in () if loader.epoch_done else loader:
            images, labels = batch[0], batch[1]
            self._set_hyper(self.schedule.lr_at(epoch + progress, self.dist.world_size), momentum)
            progress = loader.epoch_progress
            self.gaps.started()
            running.loss_sum += self._step(images, labels) * len(labels)
            self.gaps.ended()
            running.images += len(labels)
            steps += 1
            self.step += 1
            if config.visit_log is not None:
                self.visits.update(batch[2])
            self._after_step(epoch, steps, running, started)
            if config.max_steps_per_epoch and steps >= config.max_steps_per_epoch:
                break
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)  # once an epoch: the figures below are of work done
        self._running = None
        return self._part_of(running)

    def _part_of(self, running: _Running) -> EpochPart:
        """The job's figures of ``running``'s epoch so far, the steps before a resume
        included (collective: every rank calls it)."""
        loader = self.train_loader
        train_s = time.perf_counter() - running.started
        stall = (loader.wait_seconds - running.wait_before) / train_s if train_s > 0 else 0.0
        loss, images, stall_sum, idle_sum = all_reduce_sum(
            [float(running.loss_sum), running.images, stall, self.gaps.share().fraction], self.dist.device)
        longest_wait_s = all_reduce_max([loader.longest_wait_s], self.dist.device)[0]
        ranks = self.dist.world_size
        part = EpochPart(running.epoch, loss, int(images), train_s, train_s * stall_sum / ranks,
                         train_s * idle_sum / ranks, longest_wait_s)
        carried = self._carried
        return carried + part if carried is not None and carried.epoch == running.epoch else part

    def _step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.net(images)
            loss = F.cross_entropy(logits, labels,
                                   label_smoothing=self.schedule.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach().float()

    def _after_step(self, epoch: int, steps: int, running: _Running, started: float) -> None:
        config = self.config
        if config.log_every_steps and steps % config.log_every_steps == 0:
            self._say(f"  epoch {epoch} step {steps} ({self.train_loader.cursor}/"
                      f"{self.train_loader.samples_per_rank} samples) "
                      f"loss {float(running.loss_sum) / max(running.images, 1):.4f}")
        due = bool(config.checkpoint_every_steps) and self.step % config.checkpoint_every_steps == 0
        signum = self.stops.agreed(self.step) if self.stops is not None else 0
        if due or signum:
            self.elapsed_s = time.perf_counter() - started
            self._checkpoint()
        if signum:
            self._say(f"{signal.Signals(signum).name}: stopped after the checkpoint at step {self.step}")
            raise Stopped(signum, self.step)

    def _validate(self, epoch: int, phase: Any) -> Evaluation:
        every = self.config.val_every_epochs
        due = every and ((epoch + 1) % every == 0 or epoch + 1 == self.total_epochs)
        if self.val_loader is None or not due:
            return Evaluation(float("nan"), float("nan"), float("nan"), 0)
        return evaluate(self.net, self.val_loader, phase.eval_image_size, phase.batch_size,
                        self._autocast())

    def _reached(self, record: EpochRecord) -> bool:
        config = self.config
        if not config.has_target or record.val_images == 0:
            return False
        return (100 * record.val_top1 >= config.target_top1
                and 100 * record.val_top5 >= config.target_top5)

    # -- checkpoints -----------------------------------------------------------
    def _checkpoint(self) -> None:
        # Every rank's position, gathered: ranks may be a batch apart, and the job may
        # resume at another world size (clients.elastic).
        loader_state = merge_states(all_gather_objects(self.train_loader.state_dict()))  # type: ignore[arg-type]
        # Within an epoch: its figures so far, for the epoch's row after a resume.
        part = self._part_of(self._running) if self._running is not None else None
        shared = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scaler": self.scaler.state_dict(), "epoch": self.epoch, "step": self.step,
                  "elapsed_s": self.elapsed_s, "time_to_target_s": self.time_to_target_s,
                  "records": [vars(r) for r in self.log.records], "loader": loader_state,
                  "world_size": self.dist.world_size, "epoch_part": vars(part) if part else None}
        per_rank = {"rng": capture_rng(), "visits": dict(self.visits)}
        folder = save_checkpoint(self.config.checkpoints, self.step, shared, per_rank, self.dist)
        self._say(f"  checkpoint {folder} (epoch {self.epoch}, cursor "
                  f"{self.train_loader.cursor})")

    def _restore(self) -> None:
        shared, taken_over = load_checkpoint(self.config.checkpoints, self.dist)
        self.model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.scaler.load_state_dict(shared["scaler"])
        self.epoch, self.step = shared["epoch"], shared["step"]
        self.elapsed_s = shared["elapsed_s"]
        self.time_to_target_s = shared.get("time_to_target_s")
        self.log.load_records(shared["records"])
        part = shared.get("epoch_part")
        self._carried = EpochPart(**part) if part else None
        self.train_loader.load_state_dict(shared["loader"])
        saved_world = shared.get("world_size", self.dist.world_size)
        if saved_world == self.dist.world_size and taken_over:
            restore_rng(taken_over[0]["rng"])  # at another size the ranks' generators start afresh
        self.visits = sum((Counter(state["visits"]) for state in taken_over), Counter())
        self._say(f"resumed at step {self.step}: epoch {self.epoch}, cursor {self.train_loader.cursor}"
                  + (f", {saved_world} ranks then, {self.dist.world_size} now" if saved_world != self.dist.world_size
                     else ""))

    # -- the end -----------------------------------------------------------------
    def _finish(self) -> dict[str, Any]:
        config, records = self.config, self.log.records
        if config.visit_log is not None:
            config.visit_log.mkdir(parents=True, exist_ok=True)
            path = config.visit_log / f"rank-{self.dist.rank}.json"
            path.write_text(json.dumps(dict(self.visits), sort_keys=True))
        if config.checkpoint_every_steps:
            self.elapsed_s = records[-1].wall_s if records else self.elapsed_s
            self._checkpoint()
        summary = self._summary()
        if self.dist.is_main and records:
            plot_records(records, config.out_dir / "metrics.png",
                         f"{config.arch} on {config.dataset} ({config.data})")
            (config.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            self._say(f"final top-1 {summary['val_top1']:.2%} top-5 {summary['val_top5']:.2%}, "
                      f"{summary['images_per_s']:.1f} img/s, stall "
                      f"{summary['stall_fraction']:.1%}, device idle {summary['idle_fraction']:.1%}; "
                      f"log {self.log.path}")
        return summary

    def _summary(self) -> dict[str, Any]:
        records = self.log.records
        validated = [r for r in records if r.val_images]
        last = validated[-1] if validated else None
        images = sum(r.train_images for r in records)
        seconds = sum(r.train_s for r in records)
        waited = sum(r.stall_fraction * r.train_s for r in records)
        idle = sum(r.idle_fraction * r.train_s for r in records)
        return {
            "epochs": len(records), "steps": self.step, "world_size": self.dist.world_size,
            "data": self.config.data, "arch": self.config.arch,
            "transport": getattr(self.train_loader, "transport", ""),  # what carried the batches (feeder data)
            "images_per_s": images / seconds if seconds else 0.0,
            "stall_fraction": waited / seconds if seconds else 0.0,
            "idle_fraction": idle / seconds if seconds else 0.0,
            "val_top1": last.val_top1 if last else float("nan"),
            "val_top5": last.val_top5 if last else float("nan"),
            "val_images": last.val_images if last else 0,
            "time_to_target_s": self.time_to_target_s,
            "wall_s": records[-1].wall_s if records else 0.0,
            "records": [vars(r) for r in records],
        }

    def close(self) -> None:
        """Stops the loaders' streams."""
        self.train_loader.close()
        if self.val_loader is not None:
            self.val_loader.close()

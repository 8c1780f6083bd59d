"""One rank of a fault-schedule run, as its own process: a ``FeederLoader`` over the
pool (of one dataset, or a mix of two), its epochs read in order, every batch recorded (epoch, keys, labels, a hash of
each image's pixels, padding, the time the loop waited for it). Each batch costs a
training step of ``step_s``; epochs go on until the one the harness names in
``last_epoch`` in its control directory (written once its last fault is over), so
every fault meets the rank mid-epoch. It pauses while ``pause`` names a time still to
come (the consumer that makes the daemons cancel its streams).

    python -m tests.chaos.rank CONFIG.json
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import xxhash

from clients import FeederLoader


def _pause_until(control: Path) -> float:
    try:
        return float((control / "pause").read_text())
    except (OSError, ValueError):
        return 0.0


def _last_epoch(control: Path) -> int | None:
    try:
        return int((control / "last_epoch").read_text())
    except (OSError, ValueError):
        return None


def _more(epoch: int, control: Path, least: int) -> bool:
    """Whether to read ``epoch``: the first ``least`` always, the others until the
    harness has named the last."""
    last = _last_epoch(control)
    return epoch < least or last is None or epoch <= last


def _step(control: Path, step_s: float) -> None:
    """The training step after a batch, then a pause while the harness asks for one
    (looked at again every 50 ms: the harness may end it sooner than it said)."""
    time.sleep(step_s)
    while _pause_until(control) > time.time():
        time.sleep(0.05)


def main(config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    control, out = Path(config["control"]), Path(config["out"])
    logging.basicConfig(filename=config["log"], level=logging.WARNING, force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with open(out, "w") as records:
        try:
            loader = FeederLoader(address=config["addresses"], split="train", rank=config["rank"],
                                  world_size=config["world_size"], batch_size=config["batch_size"],
                                  image_size=config["image_size"], seed=config["seed"], normalize=False,
                                  return_keys=True, return_padding=True, **config["loader"])
            with loader:
                epoch = 0
                while _more(epoch, control, config["epochs"]):
                    loader.set_epoch(epoch)
                    _epoch(loader, records, control, config["step_s"])
                    epoch += 1
        except Exception as e:  # noqa: BLE001 - the rank's end, as the checker reads it
            records.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
            return 1
    return 0


def _epoch(loader: FeederLoader, records, control: Path, step_s: float) -> None:
    batches = iter(loader)
    while True:
        waited = time.monotonic()
        try:
            images, labels, keys, padding = next(batches)
        except StopIteration:
            return
        now = time.monotonic()
        records.write(json.dumps({
            "epoch": loader.epoch, "t": time.time(), "wait_s": round(now - waited, 4), "keys": list(keys),
            "labels": [int(v) for v in labels], "padding": [bool(p) for p in padding],
            "hashes": [xxhash.xxh64(image.contiguous().numpy().tobytes()).hexdigest() for image in images],
            "reconnects": loader.reconnects, "daemons": loader.daemons_in_use,
        }) + "\n")
        records.flush()
        _step(control, step_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

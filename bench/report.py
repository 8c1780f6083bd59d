"""What a benchmark run leaves behind: the table, the JSON document and the bar chart."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_VERSION", "format_store_table", "format_table", "format_targets", "git_revision", "machine_info", "plot",
    "write_document", "write_json",
]

SCHEMA_VERSION = 1
_REPO = Path(__file__).resolve().parent.parent
_UNDRAWN = "synthetic"
_NAME_WIDTH = 15  # the longest loader name, feeder-cuda-ipc
_PACKAGES = ("torch", "torchvision", "nvidia-dali-cuda130", "webdataset", "pillow", "grpcio")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _versions() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, memory, GPUs and library versions of this machine."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "memory_bytes": pages,
        "load_average_1m": os.getloadavg()[0],
        "gpus": _gpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": _versions(),
    }


def git_revision() -> dict[str, Any]:
    """The commit this code is at, and whether the working tree (any tracked or
    untracked file that is not ignored, outside ``bench/results``) differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=20).stdout.strip()

    try:
        # Results written by earlier runs of the same revision do not make it dirty.
        changes = git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
        return {"revision": git("rev-parse", "HEAD") or None, "dirty": bool(changes)}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}


def _check_recordable(path: Path, revision: dict[str, Any]) -> None:
    """Figures kept in ``bench/results`` come from a clean tree at a named commit; a
    run from a modified tree may still write elsewhere, marked ``dirty``."""
    if revision["dirty"] is False:
        return
    results = (_REPO / "bench" / "results").resolve()
    if path.resolve().is_relative_to(results):
        raise SystemExit(f"bench: refusing to write {path}: the working tree has changes not committed "
                         "(figures in bench/results come from a clean tree at a named commit)")
    print(f"bench: WARNING: the working tree is dirty; {path} is marked dirty", flush=True)


def write_document(path: Path, document: dict[str, Any]) -> dict[str, Any]:
    """Write ``document`` as JSON to ``path`` with the git revision and machine added;
    returns it. Refuses to write into ``bench/results`` from a dirty tree."""
    revision = git_revision()
    _check_recordable(path, revision)
    document = {"git": revision, "machine": machine_info(), **document}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return document


def write_json(
    path: Path, config: dict, rows: list[dict], command: list[str], targets: list[dict] | None = None
) -> dict:
    """Writes the run's document to ``path``; returns it.

    Args:
        path: file to write (its folder is created).
        config: the options of the run.
        rows: one result per measured thing.
        command: the command line that produced it.
        targets: targets checked against ``rows`` (left out when None).
    """
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": config,
        "results": rows,
    }
    if targets is not None:
        document["targets"] = targets
    return write_document(path, document)


def _fmt(value: float | None, spec: str) -> str:
    """``value`` in format ``spec`` (e.g. ``"9.2f"``), or a dash of the same width."""
    if value is None or value != value:  # missing peer, or NaN
        return "-".rjust(int(spec.split(".")[0]))
    return format(value, spec)


def format_targets(targets: list[dict], loader: str = "feeder-shm") -> str:
    """One line per target of ``loader``: the ratio reached, and whether it is met."""
    return "\n".join(
        f"{loader} vs {t['peer']}: {t['achieved_ratio']:.2f}x (target >= {t['ratio']:.2f}x) "
        f"{'met' if t['met'] else 'not met'}"
        for t in targets
    )


def format_store_table(rows: list[dict], bandwidth: dict[str, float]) -> str:
    """A ``--store s3`` run's table: each loader's first and later epochs, the ratios
    of ``bench.summary.add_store_ratios``, and the store's raw bandwidth."""
    header = (f"{'loader':<14} {'epoch 1/s':>9} {'epoch 2/s':>9} {'e1 x best peer':>14} {'e1 x local':>10} "
              f"{'e2 x local':>10} {'CPU ms/image':>12} {'peak MB':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r or "skipped" in r:
            outcome = "failed" if "error" in r else "skipped"
            lines.append(f"{r['loader']:<14} {outcome}: {r.get('error') or r['skipped']}")
            continue
        lines.append(
            f"{r['loader']:<14} {_fmt(r.get('epoch1_images_per_s'), '9.0f')} {_fmt(r['images_per_s'], '9.0f')} "
            f"{_fmt(r.get('epoch1_x_best_peer'), '14.2f')} {_fmt(r.get('epoch1_x_local'), '10.2f')} "
            f"{_fmt(r.get('x_local'), '10.2f')} {_fmt(r['cpu_s_per_image'] * 1000, '12.2f')} "
            f"{r['peak_pss_bytes'] / 2**20:8.0f}"
        )
    width = int(bandwidth.get("threads", 1))
    lines.append(f"store raw read bandwidth (whole GETs of the tars): {bandwidth.get('mb_per_s_1', 0):.0f} MB/s one at "
                 f"a time, {bandwidth.get(f'mb_per_s_{width}', 0):.0f} MB/s {width} at once = "
                 f"{bandwidth.get(f'images_per_s_{width}', 0):.0f} images/s at "
                 f"{bandwidth.get('bytes_per_image', 0):.0f} bytes/image")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """The results as a fixed-width text table (failed loaders show their error)."""
    header = (
        f"{'loader':<{_NAME_WIDTH}} {'images/s':>9} {'x inprocess':>11} {'x tfdata':>8} {'x torchvision':>13} "
        f"{'x decode-only':>13} {'CPU ms/image':>12} {'peak MB':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['loader']:<{_NAME_WIDTH}} failed: {r['error']}")
            continue
        if "skipped" in r:
            lines.append(f"{r['loader']:<{_NAME_WIDTH}} skipped: {r['skipped']}")
            continue
        cpu_ms = r["cpu_s_per_image"] * 1000
        lines.append(
            f"{r['loader']:<{_NAME_WIDTH}} {_fmt(r['images_per_s'], '9.0f')} {_fmt(r.get('x_inprocess'), '11.2f')} "
            f"{_fmt(r.get('x_tfdata'), '8.2f')} {_fmt(r.get('x_torchvision'), '13.2f')} "
            f"{_fmt(r.get('x_decode_only'), '13.2f')} {_fmt(cpu_ms, '12.2f')} "
            f"{r['peak_pss_bytes'] / 2**20:8.0f}"
        )
        if "epoch1_images_per_s" in r:
            lines.append(f"{'':<{_NAME_WIDTH}} epoch 1: {r['epoch1_images_per_s']:.0f} images/s, "
                         f"{r['epoch1_cpu_s_per_image'] * 1000:.2f} CPU ms/image; the row: later epochs")
        if r.get("clients", 1) > 1:
            rates = ", ".join(f"{x:.0f}" for x in r["per_client_images_per_s"])
            lines.append(f"{'':<{_NAME_WIDTH}} {r['clients']} clients: {rates} images/s each, "
                         f"spread {r['client_spread']:.1%}")
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], title: str, targets: list[dict] | None = None) -> None:
    """Horizontal bar chart of images/s per loader, ratios to torchvision on the bars.

    The ``synthetic`` bound (millions of images/s) is named in the title instead of
    drawn, so that the real loaders stay readable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "error" not in r and "skipped" not in r and r["loader"] != _UNDRAWN]
    bound = next((r for r in rows if r["loader"] == _UNDRAWN and "error" not in r), None)
    if bound is not None:
        title += f"\nsynthetic (harness bound): {bound['images_per_s']:,.0f} images/s"
    names = [r["loader"] for r in done]
    rates = [r["images_per_s"] for r in done]
    colours = ["tab:orange" if n.startswith("feeder") else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(done) + 2.0))
    bars = ax.barh(names, rates, color=colours)
    ax.invert_yaxis()
    for bar, row in zip(bars, done):
        ratio = row.get("x_torchvision")
        label = f" {row['images_per_s']:.0f}" + (f"  ({ratio:.2f}x torchvision)" if ratio else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=9)
    goal = max((t["target_images_per_s"] for t in targets or []), default=None)
    xlabel = "images/s (median of repeats)"
    if goal is not None:
        ax.axvline(goal, color="tab:orange", linestyle="--", linewidth=1)
        wanted = ", ".join(f">= {t['ratio']}x {t['peer']}" for t in targets or [])
        xlabel += f"\ndashed: feeder-shm target ({wanted})"
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, (max([*rates, goal or 0.0]) or 1.0) * 1.5)  # 1.0: nothing measured
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

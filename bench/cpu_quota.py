"""Processes held to a share of one core by a CPU quota: a cgroup, as a container
limit is (v1 ``cpu`` controller, or v2 ``cpu.max``). Needs root and a writable
cgroup; making one raises ``OSError`` otherwise."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CpuQuota"]

_PERIOD_US = 100_000  # the quota's period: a quota of at least 1 ms in it, so at least 0.01 core


class CpuQuota:
    """A cgroup holding processes to ``cpus`` of a core (cgroup v1 ``cpu`` or v2).

    Args:
        name: the group's name under the cgroup root.
        cpus: share of one core, e.g. 0.25.
    """

    def __init__(self, name: str, cpus: float) -> None:
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        self.path = (v1 if (v1 / "cpu.cfs_quota_us").exists() else v2) / name
        self.path.mkdir(exist_ok=True)
        quota = int(cpus * _PERIOD_US)
        if (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {_PERIOD_US}")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def lift(self) -> None:
        """Let the processes in the group run unheld (a daemon held to 2 % of a core
        takes seconds to stop otherwise)."""
        if (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_quota_us").write_text("-1")
        elif (self.path / "cpu.max").exists():
            (self.path / "cpu.max").write_text(f"max {_PERIOD_US}")

    def remove(self) -> None:
        """Remove the group, once the processes in it have ended (else it is lifted)."""
        try:
            self.path.rmdir()
        except OSError:  # still busy: the kernel removes nothing a process is in
            try:
                self.lift()
            except OSError:
                pass

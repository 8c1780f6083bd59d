"""A real one-host Slurm cluster for tests: ``munged``, ``slurmctld`` and ``slurmd``
run as child processes of the test, every file they use (munge key and socket,
``slurm.conf``, state, spool, pid and log files, the job completion log) under a
directory the test owns, on free ports, so that it needs no system configuration and
two clusters on one host (two pytest workers) do not meet.

Usage::

    with slurm_cluster(tmp_path) as slurm:
        job = slurm.submit("--wait", "--wrap", "hostname")
        assert slurm.final_state(job) == "COMPLETED"

:func:`slurm_or_skip` is the same, but skips the test (one line saying why) where
Slurm or munge is not installed, we are not root, or the daemons do not start here.

The container this runs in has no systemd and no usable cgroups, hence
``proctrack/linuxproc`` (a job's processes are found by parent pid) and
``task/none``. Without slurmdbd there is no accounting (``sacct`` answers "Slurm
accounting storage is disabled"), so a job's final state comes from the job
completion log (``jobcomp/filetxt``: one ``JobId=N ... JobState=S ...`` line each
time a job ends or is requeued); :meth:`SlurmCluster.final_state` waits until
``scontrol show job`` says the job has ended (or has forgotten it) and reads it there.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.seaweedfs import free_ports

__all__ = ["SlurmCluster", "SlurmUnavailable", "slurm_cluster", "slurm_missing", "slurm_or_skip"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
TERMINAL_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                             "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})
# Set in the daemons' environment and the clients': every process of this cluster,
# its jobs' included (sbatch passes the submitter's environment on), carries it.
MARKER = "FEEDER_TEST_SLURM"
KILL_WAIT_S = 5  # SIGTERM to SIGKILL of a cancelled job's processes
START_TIMEOUT_S = 60.0  # a loaded 2-core machine: the node idle in 2 to 10 s
STOP_TIMEOUT_S = 10.0
_CLIENT_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message is one line saying why."""


@dataclass
class SlurmCluster:
    """One running cluster: one node (this host's short name), one default partition.

    Attributes:
        root: its directory (``slurm.conf``, ``jobcomp.txt``, ``log/``, ``munge/``...).
        conf: its ``slurm.conf``.
        node: the node's name (``hostname -s``).
        env: the environment of its client commands (sbatch, squeue, scancel,
            scontrol): this process's, without any Slurm variable it inherited,
            with ``SLURM_CONF`` and the marker.
        jobcomp: the job completion log.
    """

    root: Path
    conf: Path
    node: str
    env: dict[str, str]
    jobcomp: Path
    _daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(self, *args: str, env: dict[str, str] | None = None, check: bool = True,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A client command (``sbatch ...``, ``squeue ...``) against this cluster.

        Args:
            args: the command and its arguments.
            env: variables to add to :attr:`env` (a job's overrides).
            check: raise on a non-zero exit status.
            timeout_s: how long it may take.

        Raises:
            RuntimeError: ``check`` and it failed (with its output).
        """
        result = subprocess.run(list(args), env={**self.env, **(env or {})}, capture_output=True,
                                text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
        return result

    def submit(self, *args: str, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> int:
        """``sbatch --parsable ARGS``; returns the job id. With ``--wait`` among the
        arguments it returns when the job has ended, whatever its exit status (see
        :meth:`final_state`)."""
        result = self.run("sbatch", "--parsable", *args, env=env, check="--wait" not in args,
                          timeout_s=timeout_s)
        first = result.stdout.strip().splitlines()[:1]
        if not first or not first[0].split(";")[0].isdigit():
            raise RuntimeError(f"sbatch {' '.join(args)}: no job id: {result.stdout.strip()} {result.stderr.strip()}")
        return int(first[0].split(";")[0])

    def state(self, job: int) -> str | None:
        """The job's state now (``PENDING``, ``RUNNING``, ``COMPLETED``...), from
        ``scontrol show job``; None once the controller has forgotten it (``MinJobAge``
        seconds after it ended, at its next purge)."""
        result = self.run("scontrol", "-o", "show", "job", str(job), check=False)
        if result.returncode != 0 and "invalid job id" in result.stderr.lower():
            return None
        if result.returncode != 0:
            raise RuntimeError(f"scontrol show job {job}: {result.stderr.strip()}")
        return next(f.split("=", 1)[1] for f in result.stdout.split() if f.startswith("JobState="))

    def wait_state(self, job: int, states: Collection[str | None], timeout_s: float = 120.0) -> str | None:
        """Waits until the job's state is one of ``states``; returns it.

        Raises:
            TimeoutError: not within ``timeout_s`` (names the last state seen).
        """
        deadline = time.monotonic() + timeout_s
        while (now := self.state(job)) not in states:
            if time.monotonic() > deadline:
                wanted = ", ".join(sorted(map(str, states)))
                raise TimeoutError(f"job {job} still {now} after {timeout_s:.0f} s (waiting for {wanted})")
            time.sleep(0.2)
        return now

    def final_state(self, job: int, timeout_s: float = 120.0) -> str:
        """The state the job ended in, as the job completion log recorded it (its last
        line of the job), once the controller says it has ended.

        Raises:
            TimeoutError: it has not ended within ``timeout_s``.
            RuntimeError: it ended and the log has no line saying how.
        """
        ended = self.wait_state(job, {*TERMINAL_STATES, None}, timeout_s)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            recorded = self.completion_states(job)
            if recorded and recorded[-1] in TERMINAL_STATES:
                return recorded[-1]
            time.sleep(0.1)
        raise RuntimeError(f"job {job} ended ({ended or 'forgotten'}) but {self.jobcomp} has no final line of it: "
                           f"{self.completion_states(job)}")

    def completion_states(self, job: int) -> list[str]:
        """Every state the job completion log recorded for the job, oldest first (a
        requeued job has a line for each time it stopped)."""
        if not self.jobcomp.is_file():
            return []
        states = []
        for line in self.jobcomp.read_text().splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if fields.get("JobId") == str(job):
                states.append(fields.get("JobState", ""))
        return states

    def job_processes(self) -> list[tuple[int, str]]:
        """``(pid, command line)`` of every process this cluster's jobs left running:
        those with the cluster's marker in their environment, other than its daemons
        and their own children (slurmctld's ``slurmscriptd``)."""
        daemons = {p.pid for p in self._daemons.values()}
        return [(pid, line) for pid, parent, line in _marked_processes(self.env[MARKER])
                if pid not in daemons and parent not in daemons]

    def cancel_all(self, timeout_s: float = 30.0) -> None:
        """Cancels every job and waits until none is left (not even completing)."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancels the jobs, stops slurmd, slurmctld and munged, and kills whatever the
        jobs left behind: nothing of the cluster runs when this returns."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self.cancel_all()
        for name in reversed(DAEMONS):
            if name == "munged":
                _kill_all(self.job_processes())  # the jobs' stray processes, then munge
            process = self._daemons.pop(name, None)
            if process is not None:
                _stop(process)


def slurm_missing() -> str | None:
    """Why Slurm cannot run here (one line), or None."""
    absent = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if absent:
        return f"slurm: {', '.join(absent)} not installed (make slurm installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "slurm: slurmd must run as root here (SlurmdUser=root) and this is not root"
    return None


@contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """A running one-host cluster under ``root`` (created); stopped on exit.

    Raises:
        SlurmUnavailable: it is not installed, or a daemon did not start (the reason,
            with the end of its log, in one line).
    """
    reason = slurm_missing()
    if reason is not None:
        raise SlurmUnavailable(reason)
    cluster = _prepare(Path(root))
    try:
        _start(cluster)
        yield cluster
    finally:
        cluster.stop()


@contextmanager
def slurm_or_skip(root: Path) -> Iterator[SlurmCluster]:
    """:func:`slurm_cluster`, or the test skipped with the one-line reason."""
    with ExitStack() as stack:
        try:
            cluster = stack.enter_context(slurm_cluster(root))
        except SlurmUnavailable as e:
            pytest.skip(str(e))
        yield cluster


def _prepare(root: Path) -> SlurmCluster:
    for folder in ("munge", "state", "spool", "log"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, *free_ports(2)))
    (root / "plugstack.conf").write_text("")  # none of the host's SPANK plugins
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_PREFIXES)}
    env |= {"SLURM_CONF": str(conf), MARKER: str(root)}
    return SlurmCluster(root=root, conf=conf, node=node, env=env, jobcomp=root / "jobcomp.txt")


def _memory_mb() -> int:
    """Below what slurmd measures (MemTotal), or it drains the node."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 * 3 // 4
    return 1024


def _slurm_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    return "\n".join([
        "ClusterName=feedertest",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job waits this long before it may run again (120 s by default)
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'},cred_expire=10",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        f"PlugStackConfig={root / 'plugstack.conf'}",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",  # no cgroups in this container
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        f"KillWait={KILL_WAIT_S}",
        "MessageTimeout=30",  # a loaded machine answers slowly
        # scontrol knows a finished job this long (until the next purge, each minute);
        # below 6 s sbatch --wait asks every 2 s, above it every 8 s, then every 32 s.
        "MinJobAge=5",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root / 'jobcomp.txt'}",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory={_memory_mb()} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _start(cluster: SlurmCluster) -> None:
    root, conf = cluster.root, str(cluster.conf)
    munge = root / "munge"
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    # -f: the socket's directory is the test's own (mode 0700), which munged would
    # refuse for other users; only root talks to it here.
    _spawn(cluster, "munged", ["munged", "-F", "-f", f"--socket={munge / 'munge.socket'}", f"--key-file={key}",
                               f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                               f"--seed-file={munge / 'munged.seed'}"])
    _wait(cluster, "munged", lambda: (munge / "munge.socket").exists())
    _spawn(cluster, "slurmctld", ["slurmctld", "-D", "-f", conf])
    _wait(cluster, "slurmctld", lambda: cluster.run("scontrol", "ping", check=False).returncode == 0)
    _spawn(cluster, "slurmd", ["slurmd", "-D", "-f", conf, "-N", cluster.node])
    _wait(cluster, "slurmd", lambda: _node_state(cluster) == "idle")


def _spawn(cluster: SlurmCluster, name: str, command: list[str]) -> None:
    with open(cluster.root / "log" / f"{name}.out", "ab") as out:
        cluster._daemons[name] = subprocess.Popen(command, env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True)


def _node_state(cluster: SlurmCluster) -> str:
    return cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()


def _wait(cluster: SlurmCluster, name: str, ready: Callable[[], bool]) -> None:
    """Waits for ``ready()``; SlurmUnavailable if the daemon exits or it takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    process = cluster._daemons[name]
    while not ready():
        if process.poll() is not None:
            raise SlurmUnavailable(f"slurm: {name} exited with status {process.returncode} here: "
                                   f"{_last_line(cluster, name)}")
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"slurm: {name} not ready after {START_TIMEOUT_S:.0f} s: "
                                   f"{_last_line(cluster, name)}")
        time.sleep(0.1)


def _last_line(cluster: SlurmCluster, name: str) -> str:
    """The daemon's fatal error, else the last line it logged."""
    lines: list[str] = []
    for log in (cluster.root / "log" / f"{name}.out", cluster.root / "log" / f"{name}.log"):
        if log.is_file():
            lines += [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    fatal = [line for line in lines if "fatal" in line.lower()]
    return (fatal or lines or ["nothing in its log"])[-1]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _marked_processes(marker: str) -> list[tuple[int, int, str]]:
    """``(pid, parent pid, command line)`` of the processes whose environment has
    ``MARKER=marker``, this one aside."""
    wanted = f"{MARKER}={marker}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if wanted not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if int(proc.name) != os.getpid() and line:
            found.append((int(proc.name), parent, line))
    return found


def _kill_all(processes: list[tuple[int, str]]) -> None:
    for pid, _ in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

"""Virtual environments of their own for the loaders whose packages clash with the project's.

Some peers want versions of numpy, OpenCV or torch, or compiled extensions, that the
project's own environment must not be bent to (FFCV builds against the system's
libturbojpeg and OpenCV; SPDL loads the system's FFmpeg). Such a loader module names an
``Environment`` in its ``ENVIRONMENT`` attribute; the bench makes it once, under
``CACHE/venv-NAME`` (``CACHE`` is ``throughput.py --cache``, ``.bench/`` by default):

1. the Debian packages it needs (headers, shared libraries) are installed with
   ``apt-get`` when missing, if the bench runs as root (it says so in one line), or
   else the loader is skipped with the command that would install them;
2. ``python -m venv`` from the interpreter running the bench, then ``pip install`` of
   the pinned requirements (the log is ``CACHE/venv-NAME.log``);
3. ``check`` runs in the new interpreter (an import that fails there skips the loader,
   naming the error); only then is the stamp written, so a half-made environment is
   made again on the next run, and a change of requirements remakes it.

The loader's worker then runs in that interpreter (``bench/worker.py`` and the modules it
imports use the standard library only, so they run in any of them). None of this is
part of the test suite: only the bench makes environments.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.loaders.base import LoaderUnavailable

__all__ = ["Environment", "interpreter", "is_made", "missing_debian_packages"]

# Seconds one pip install may take (torch and its CUDA libraries from a local index
# take about two minutes; a source build of a C extension a few more).
_PIP_TIMEOUT_S = 1800.0
_APT_TIMEOUT_S = 900.0
_CHECK_TIMEOUT_S = 300.0
_STAMP = "bench-environment.json"
# A line of a log that says what failed (pip's, apt's, a Python traceback's last).
_ERROR_LINE = re.compile(r"^(ERROR|error|E:)|\w+Error\b")


@dataclass(frozen=True)
class Environment:
    """What a loader's own virtual environment holds.

    Args:
        name: folder name: the environment is ``CACHE/venv-<name>``.
        requirements: pip requirement specifiers, pinned (``ffcv==1.0.2``).
        check: Python code run with ``python -c`` in the environment once it is made;
            it must exit 0 (an import of what the loader uses).
        debian_packages: Debian packages the requirements build against or load at
            run time, installed with ``apt-get`` when missing.
    """

    name: str
    requirements: tuple[str, ...]
    check: str
    debian_packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or not self.requirements:
            raise ValueError("an environment needs a plain folder name and at least one requirement")

    def stamp(self) -> str:
        """What the stamp file of a finished environment holds: changes with any field."""
        text = json.dumps(asdict(self), sort_keys=True)
        return json.dumps({"environment": asdict(self), "sha256": hashlib.sha256(text.encode()).hexdigest()})


def _say(line: str) -> None:
    print(f"throughput: {line}", file=sys.stderr, flush=True)


def missing_debian_packages(names: tuple[str, ...], query: str = "dpkg-query") -> list[str]:
    """The packages of ``names`` that dpkg does not list as installed (none when dpkg
    is absent: not a Debian system, where pip and the check tell what is missing).

    Args:
        names: Debian package names.
        query: the dpkg-query command (tests point it elsewhere).
    """
    if not names:
        return []
    if shutil.which(query) is None:
        return []
    missing = []
    for name in names:
        done = subprocess.run(
            [query, "-W", "-f=${db:Status-Abbrev}", name], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not done.stdout.startswith("ii"):
            missing.append(name)
    return missing


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return (errors or lines or ["(no output)"])[-1][:300]


def _run_logged(command: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, env=env,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            out.write(f"timed out after {timeout_s:.0f} s\n")
            return 124
        except OSError as e:
            out.write(f"{e}\n")
            return 127


def _install_debian(env: Environment, log: Path) -> None:
    """Installs the missing Debian packages when this process may, else says how.

    Raises:
        LoaderUnavailable: packages are missing and cannot be installed here.
    """
    missing = missing_debian_packages(env.debian_packages)
    if not missing:
        return
    names = " ".join(missing)
    if shutil.which("apt-get") is None:
        raise LoaderUnavailable(f"needs the Debian packages {names}, and apt-get is absent")
    if os.geteuid() != 0:
        raise LoaderUnavailable(f"needs the Debian packages {names}: run 'apt-get install {names}' as root")
    _say(f"installing Debian packages for {env.name} with apt-get: {names} (log: {log})")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if _run_logged(command, log, _APT_TIMEOUT_S, apt_env) != 0:  # the package lists may be stale or absent
        _run_logged(["apt-get", "update", "-q"], log, _APT_TIMEOUT_S, apt_env)
        if _run_logged(command, log, _APT_TIMEOUT_S, apt_env) != 0:
            raise LoaderUnavailable(f"apt-get install {names} failed ({_last_line(log)}; log: {log})")


def _make(env: Environment, venv: Path, log: Path, base_python: str) -> None:
    """Creates ``venv``, installs the requirements and runs the check.

    Raises:
        LoaderUnavailable: a step failed; the reason names it and the log.
    """
    shutil.rmtree(venv, ignore_errors=True)
    if _run_logged([base_python, "-m", "venv", str(venv)], log, _CHECK_TIMEOUT_S) != 0:
        raise LoaderUnavailable(f"python -m venv {venv} failed ({_last_line(log)}; log: {log})")
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--no-input", *env.requirements]
    if _run_logged(pip, log, _PIP_TIMEOUT_S) != 0:
        raise LoaderUnavailable(f"pip install {' '.join(env.requirements)} failed ({_last_line(log)}; log: {log})")
    if _run_logged([str(python), "-c", env.check], log, _CHECK_TIMEOUT_S) != 0:
        raise LoaderUnavailable(f"the check of {venv} failed ({_last_line(log)}; log: {log})")


def _paths(env: Environment, cache: Path) -> tuple[Path, Path, Path]:
    venv = Path(cache) / f"venv-{env.name}"
    return venv, venv / "bin" / "python", venv / _STAMP


def is_made(env: Environment, cache: Path) -> bool:
    """Whether ``env`` was made under ``cache``, with its current requirements."""
    _, python, stamp = _paths(env, cache)
    return python.exists() and stamp.is_file() and stamp.read_text() == env.stamp()


def interpreter(env: Environment, cache: Path, base_python: str = sys.executable,
                install_debian: Callable[[Environment, Path], None] = _install_debian) -> Path:
    """The Python of ``env``'s virtual environment under ``cache``, made first if needed.

    Args:
        env: what the environment holds.
        cache: folder of the environments (``throughput.py --cache``).
        base_python: interpreter that creates the environment.
        install_debian: installs ``env.debian_packages`` (tests replace it).

    Returns:
        ``cache/venv-<name>/bin/python``.

    Raises:
        LoaderUnavailable: the environment cannot be made here (one line: why, and the log).
    """
    venv, python, stamp = _paths(env, cache)
    if is_made(env, cache):
        return python
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / f"venv-{env.name}.log"
    log.write_text("")
    install_debian(env, log)
    _say(f"making {venv} for {env.name}: pip install {' '.join(env.requirements)} (once; log: {log})")
    _make(env, venv, log, base_python)
    stamp.write_text(env.stamp())
    return python

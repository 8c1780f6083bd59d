"""The loaders' own virtual environments: when one counts as made, and how a failure to
make one reads (without making any: only the bench does, never the test suite)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from bench.loaders import LOADERS, LoaderUnavailable, loader_module
from bench.venvs import Environment, interpreter, is_made, missing_debian_packages

ENV = Environment(name="peer", requirements=("somepeer==1.0",), check="import somepeer", debian_packages=("bash",))


def _made(env: Environment, cache: Path) -> Path:
    """A folder laid out as a finished environment of ``env`` (its python, its stamp)."""
    python = cache / f"venv-{env.name}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    (python.parent.parent / "bench-environment.json").write_text(env.stamp())
    return python


def _never(env: Environment, log: Path) -> None:
    raise AssertionError("an environment already made installs nothing")


def test_a_made_environment_is_used_as_it_is(tmp_path: Path) -> None:
    python = _made(ENV, tmp_path)

    assert is_made(ENV, tmp_path)
    assert interpreter(ENV, tmp_path, install_debian=_never) == python


def test_other_requirements_or_a_missing_stamp_mean_the_environment_is_not_made(tmp_path: Path) -> None:
    python = _made(ENV, tmp_path)
    changed = Environment(name="peer", requirements=("somepeer==2.0",), check="import somepeer")

    assert not is_made(changed, tmp_path)
    assert ENV.stamp() != changed.stamp()
    (python.parent.parent / "bench-environment.json").unlink()
    assert not is_made(ENV, tmp_path)


def test_an_environment_that_cannot_be_made_skips_the_loader_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(LoaderUnavailable) as caught:
        interpreter(ENV, tmp_path, base_python=str(tmp_path / "no-such-python"), install_debian=lambda env, log: None)

    reason = str(caught.value)
    assert "python -m venv" in reason and "venv-peer.log" in reason and "\n" not in reason
    assert not is_made(ENV, tmp_path)


def test_debian_packages_are_checked_with_dpkg(tmp_path: Path) -> None:
    if shutil.which("dpkg-query") is None:
        pytest.skip("not a Debian system")
    assert missing_debian_packages(("bash", "feeder-no-such-package")) == ["feeder-no-such-package"]
    assert missing_debian_packages(("bash",), query=str(tmp_path / "no-dpkg-query")) == []  # no dpkg: not checked


def test_missing_packages_without_apt_get_skip_the_loader_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dpkg = shutil.which("dpkg-query")
    if dpkg is None:
        pytest.skip("not a Debian system")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dpkg-query").symlink_to(dpkg)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # dpkg-query, and no apt-get
    env = Environment(name="peer", requirements=("somepeer==1.0",), check="pass",
                      debian_packages=("feeder-no-such-package",))

    with pytest.raises(LoaderUnavailable, match="feeder-no-such-package, and apt-get is absent"):
        interpreter(env, tmp_path / "cache")


def test_environments_need_a_plain_name_and_requirements() -> None:
    with pytest.raises(ValueError):
        Environment(name="a/b", requirements=("x",), check="pass")
    with pytest.raises(ValueError):
        Environment(name="x", requirements=(), check="pass")


def test_the_peers_with_environments_name_their_pins_and_their_system_packages() -> None:
    environments = {n: getattr(loader_module(n), "ENVIRONMENT", None) for n in LOADERS}

    assert {n for n, e in environments.items() if e is not None} == {"ffcv", "spdl", "streaming", "webdataset-s3",
                                                                       "litdata"}
    for env in filter(None, environments.values()):
        assert all("==" in r for r in env.requirements), env.name  # pinned
        assert env.check
    # The ones that build or load native libraries of the system name them.
    assert all(environments[n].debian_packages for n in ("ffcv", "spdl"))  # type: ignore[union-attr]

"""The install's uv options: pip's configured indexes, wheel folders and constraints,
each once, and pip's choice among indexes."""

from __future__ import annotations

import subprocess
import sys

from deploy.uv_args import uv_args
from tests.common.env import ROOT, child_env

STRATEGY = ["--index-strategy", "unsafe-best-match"]


def test_each_configured_index_folder_and_constraint_is_given_once_in_pips_order():
    listed = [":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
              ":env:.find-links='/opt/wheels'",
              "global.constraint='/etc/xdg/pip/constraints.txt'",
              "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
              "global.find-links='/opt/wheels'",
              "global.index-url='https://mirror.example/simple'",
              "global.timeout='60'"]
    assert uv_args(listed) == [*STRATEGY, "--find-links", "/opt/wheels", "--constraint", "/etc/xdg/pip/constraints.txt",
                               "--extra-index-url", "file:///opt/pypi/simple",
                               "--extra-index-url", "file:///opt/pypi-more/simple",
                               "--index-url", "https://mirror.example/simple"]


def test_no_index_is_a_switch_and_nothing_configured_leaves_pips_choice_alone():
    assert uv_args(["install.no-index='true'", "global.find-links='/wheels here'"]) == [
        *STRATEGY, "--no-index", "--find-links", "/wheels", "--find-links", "here"]
    assert uv_args(["install.no-index='false'"]) == STRATEGY
    assert uv_args([]) == STRATEGY


def test_the_script_reads_this_machines_pip_configuration():
    env = child_env(PIP_FIND_LINKS="/somewhere/wheels")
    printed = subprocess.run([sys.executable, "deploy/uv_args.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    assert printed.startswith("--index-strategy unsafe-best-match") and "--find-links /somewhere/wheels" in printed

"""``uv pip install``'s options for the indexes pip is configured with on this machine
(``pip config list``: its files and ``PIP_*`` variables), printed on one line for the
Makefile's install. uv reads no pip configuration of its own accord; given the same
indexes, wheel folders and constraints, and pip's choice among indexes (the best
version in any of them, ``unsafe-best-match``), it installs what pip would.

    python deploy/uv_args.py    # e.g. --index-strategy unsafe-best-match --find-links /opt/wheels ...
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's option: uv's, and whether it takes several values (whitespace between them).
OPTIONS = {
    "index-url": ("--index-url", False),
    "extra-index-url": ("--extra-index-url", True),
    "find-links": ("--find-links", True),
    "constraint": ("--constraint", True),
    "no-index": ("--no-index", None),
}


def uv_args(config_lines: list[str]) -> list[str]:
    """uv's options for ``pip config list``'s lines (``section.key='value'``), each
    value once, in the order pip lists them."""
    args = ["--index-strategy", "unsafe-best-match"]
    seen: set[tuple[str, str]] = set()
    for line in config_lines:
        name, _, quoted = line.partition("=")
        option = OPTIONS.get(name.rpartition(".")[2])
        if option is None or not quoted:
            continue
        flag, several = option
        value = " ".join(shlex.split(quoted))
        if several is None:  # a switch
            if value.lower() in ("1", "true", "yes", "on") and (flag, "") not in seen:
                seen.add((flag, ""))
                args.append(flag)
            continue
        for one in value.split() if several else [value]:
            if (flag, one) not in seen:
                seen.add((flag, one))
                args += [flag, one]
    return args


def main() -> None:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    print(shlex.join(uv_args(listed.splitlines())))


if __name__ == "__main__":
    main()

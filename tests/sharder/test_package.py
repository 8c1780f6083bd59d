"""The ``sharder`` package: names load on first use (importing it costs no Pillow),
and ``sharder.shard`` is the function even after the submodule of that name loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_importing_the_configs_loads_no_pillow_or_opencv() -> None:
    assert _run("import sys, sharder.config, sharder.commands; print('PIL' in sys.modules, 'cv2' in sys.modules)") \
        == "False False\n"


def test_shard_is_the_function_whichever_import_comes_first() -> None:
    code = "import sharder.shard\nfrom sharder import shard, ShardReport\nprint(callable(shard), shard.__module__)"
    assert _run(code) == "True sharder.shard\n"


def test_an_unknown_name_is_an_attribute_error() -> None:
    assert _run("import sharder\ntry:\n    sharder.nothing\nexcept AttributeError as e:\n    print(e)") \
        == "module 'sharder' has no attribute 'nothing'\n"

"""core.bad_input: the pixel limit is Pillow's, without importing Pillow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core.bad_input import DEFAULT_MAX_PIXELS, ON_ERROR


def test_default_max_pixels_is_pillows_bomb_threshold() -> None:
    from PIL import Image

    assert DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS == (1 << 30) // 4 // 3


def test_importing_it_loads_no_pillow() -> None:
    code = "import sys, core.bad_input; print('PIL' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    found = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert found.stdout == "False\n"


def test_sharder_and_daemon_share_the_words() -> None:
    from feeder.config import ON_ERROR as SERVE_ON_ERROR
    from sharder.config import ON_ERROR_POLICIES

    assert ON_ERROR == SERVE_ON_ERROR == ON_ERROR_POLICIES == ("skip", "fail")

"""``python -m clients.train``, deprecated: the bundled trainer's command is
``python -m trainer.train`` (``torchrun ... -m trainer.train``) since the trainer has a
package of its own. This alias prints one warning line and runs that command."""

from __future__ import annotations

import os

from core.cli import print_warning

__all__ = ["main"]


def main() -> None:
    """Warns once per job (on rank 0 under torchrun), then trains as ``trainer.train``."""
    if os.environ.get("RANK", "0") == "0":
        print_warning("python -m clients.train is deprecated, use python -m trainer.train")
    from trainer.train import main as train  # a deprecated alias: allowed up a layer (tests/test_imports.py)

    train()


if __name__ == "__main__":
    main()

"""What decodes JPEG windows on the CPU, by name: ``libjpeg-turbo`` (the project's
window decoder, :mod:`shards.jpeg`), ``dali`` (DALI's ROI decode), or ``auto``, the
first where it was built."""

from __future__ import annotations

from core.errors import ConfigError

__all__ = ["CPU_DECODERS", "check_cpu_decoder", "cpu_decoder_in_use"]


# What decodes JPEG windows on the CPU (the daemon's ``--cpu-decoder``).
CPU_DECODERS = ("auto", "libjpeg-turbo", "dali")


def check_cpu_decoder(choice: str) -> None:
    """Raises ConfigError unless ``choice`` is one of ``CPU_DECODERS`` and can be used
    here (``libjpeg-turbo`` needs the JPEG library of ``shards``)."""
    if choice not in CPU_DECODERS:
        raise ConfigError(f"cpu_decoder: {choice!r} is not one of {', '.join(CPU_DECODERS)}")
    if choice != "libjpeg-turbo":
        return
    from shards import jpeg

    if not jpeg.available():
        raise ConfigError(f"cpu_decoder: libjpeg-turbo: {jpeg.unavailable_reason()}")


def cpu_decoder_in_use(choice: str) -> str:
    """What decodes for a (checked) ``choice``: ``auto`` is ``libjpeg-turbo`` where the
    JPEG library was built, else ``dali``."""
    if choice == "auto":
        from shards import jpeg

        return "libjpeg-turbo" if jpeg.available() else "dali"
    return choice

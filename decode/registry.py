"""Decoders by name: :data:`DECODERS` maps a name to its class, and what decodes a
pipeline is a lookup in it, not an if-chain (after MosaicML Streaming's format
registry, ``streaming/base/format/__init__.py``).

A new decoder is a module of its own (a :class:`decode.decoder.PhasedDecoder`, built
from the pipeline's spec and a lane, that says where it decodes and whether it can run
here) and one line in ``DECODERS``; the daemon's ``--cpu-decoder`` then takes its
name. What decodes a pipeline (:func:`decoder_name`): on a GPU, the first GPU decoder
that can run; on the CPU, the one named, or for ``auto`` the first CPU decoder that
can run, in ``DECODERS``' order (the project's window decoder where it was built, else
DALI's). A GPU pipeline's batches are split with the CPU (:mod:`decode.split_decoder`)
where its spec gives the CPU a share and ``SPLIT_CPU_PART`` can run here: of the CPU
decoders, it alone writes into a device slot.
"""

from __future__ import annotations

from core.errors import ConfigError
from core.workers import Lane
from decode.dali import DaliCpuDecoder, DaliGpuDecoder
from decode.decoder import Decoder, PhasedDecoder
from decode.pipeline import PipelineSpec
from decode.split_decoder import CpuShare, SplitDecoder
from decode.turbo import TurboDecoder

__all__ = [
    "AUTO",
    "DECODERS",
    "SPLIT_CPU_PART",
    "check_cpu_decoder",
    "cpu_decoder_in_use",
    "cpu_decoders",
    "decoder_name",
    "make_decoder",
]

DECODERS: dict[str, type[PhasedDecoder]] = {
    "libjpeg-turbo": TurboDecoder,
    "dali": DaliCpuDecoder,
    "nvjpeg": DaliGpuDecoder,
}
AUTO = "auto"  # the first CPU decoder that can run here
SPLIT_CPU_PART = "libjpeg-turbo"


def cpu_decoders() -> tuple[str, ...]:
    """What ``--cpu-decoder`` takes: ``auto``, then each CPU decoder's name in order."""
    return (AUTO, *(name for name, kind in DECODERS.items() if kind.device == "cpu"))


def check_cpu_decoder(choice: str) -> None:
    """Refuse a CPU decoder that is not registered or cannot run here.

    Raises:
        ConfigError: ``choice`` is not one of :func:`cpu_decoders`, or the decoder it
            names cannot run here (naming why).
    """
    if choice not in cpu_decoders():
        raise ConfigError(f"cpu_decoder: {choice!r} is not one of {', '.join(cpu_decoders())}")
    why = None if choice == AUTO else DECODERS[choice].unavailable_reason()
    if why is not None:
        raise ConfigError(f"cpu_decoder: {choice}: {why}")


def cpu_decoder_in_use(choice: str) -> str:
    """What decodes on the CPU for a (checked) ``choice``: the decoder it names, or for
    ``auto`` the first that can run here.

    Raises:
        ConfigError: ``auto`` where no CPU decoder can run.
    """
    if choice != AUTO:
        return choice
    for name in cpu_decoders()[1:]:
        if DECODERS[name].unavailable_reason() is None:
            return name
    raise ConfigError(f"cpu_decoder: none of {', '.join(cpu_decoders()[1:])} can run here")


def decoder_name(spec: PipelineSpec) -> str:
    """The name of what decodes ``spec``'s batches (see the module doc).

    Raises:
        ConfigError: a CPU decoder that is not registered or cannot run here; no GPU
            decoder that can run.
    """
    if spec.device == "cpu":
        check_cpu_decoder(spec.cpu_decoder)
        return cpu_decoder_in_use(spec.cpu_decoder)
    for name, kind in DECODERS.items():
        if kind.device == spec.device and kind.unavailable_reason() is None:
            return name
    raise ConfigError(f"device: no {spec.device} decoder can run here")


def make_decoder(spec: PipelineSpec, lane: Lane) -> Decoder:
    """The decoder of ``spec`` (:func:`decoder_name`; on a GPU split with the CPU, see
    the module doc); its CPU work runs on ``lane``, DALI's own on DALI's
    ``spec.threads`` threads.

    Raises:
        ConfigError: as :func:`decoder_name`.
    """
    decoder = DECODERS[decoder_name(spec)](spec, lane)
    split = DECODERS[SPLIT_CPU_PART]
    if spec.device == "cpu" or spec.cpu_decode_share == 0 or split.unavailable_reason() is not None:
        return decoder
    return SplitDecoder(split(spec, lane), decoder, CpuShare(spec.cpu_decode_share))

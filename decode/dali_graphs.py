"""The DALI graphs and their build: a CPU pipeline that decodes each sample's crop
window only (:func:`crop_decode_pipeline`), and a GPU one that decodes with nvJPEG and
finishes the batch there (:func:`gpu_pipeline`). DALI loads with this module, which
the DALI decoders (:mod:`decode.dali`) import when the first of them is built: a
daemon whose batches the window decoder decodes never loads it.
"""

from __future__ import annotations

from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.pipeline import Pipeline

from decode.finish import finish_graph
from decode.pipeline import ANCHORS, JPEGS, SHAPES, PipelineSpec

__all__ = ["build_dali", "crop_decode_pipeline", "gpu_pipeline"]


def _decode_window(jpegs, anchors, shapes, device: str, **mixed):  # type: ignore[no-untyped-def]
    return fn.decoders.image_slice(
        jpegs, anchors, shapes,
        device=device,
        **mixed,
        output_type=types.DALIImageType.RGB,
        normalized_anchor=False,
        normalized_shape=False,
        axis_names="WH",  # anchors and shapes are (x, y) and (width, height)
        # Windows are drawn in the stored pixel grid (the index's width/height), as
        # torchvision's PIL path sees it; an EXIF rotation would move them.
        adjust_orientation=False,
    )


def _window_inputs():  # type: ignore[no-untyped-def]
    jpegs = fn.external_source(name=JPEGS, dtype=types.DALIDataType.UINT8, ndim=1)
    anchors = fn.external_source(name=ANCHORS, dtype=types.DALIDataType.FLOAT, ndim=1)
    shapes = fn.external_source(name=SHAPES, dtype=types.DALIDataType.FLOAT, ndim=1)
    return jpegs, anchors, shapes


@pipeline_def
def crop_decode_pipeline():  # type: ignore[no-untyped-def]
    """CPU: decode each sample's crop window only.

    Inputs (external_source): ``jpegs`` (uint8 bytes), ``anchors`` and ``shapes``
    (float32 ``[x, y]`` and ``[width, height]`` in pixels) per sample.
    Output: uint8 HWC RGB windows of varying sizes.
    """
    return _decode_window(*_window_inputs(), device="cpu")


@pipeline_def
def gpu_pipeline(  # type: ignore[no-untyped-def]
    antialias: bool, hw_decoder_load: float = 0.65, decode_on: str = "mixed", photometric: bool = False
):
    """GPU: decode each window with nvJPEG (``hw_decoder_load`` of the data on the
    hardware JPEG engines, where the GPU has them), then finish it there
    (:func:`decode.finish.finish_graph`: resized to the run's size, mirrored, toned
    with ``photometric``).

    Inputs: as :func:`crop_decode_pipeline`, plus the finishing stage's
    (:func:`decode.finish.feed`). Output: uint8 HWC, RGB. ``decode_on="cpu"`` builds
    the same graph on DALI's CPU backend (``device_id=None``): how its finishing is
    checked against the CPU's where there is no GPU.
    """
    jpegs, anchors, shapes = _window_inputs()
    mixed = {"hw_decoder_load": hw_decoder_load} if decode_on == "mixed" else {}
    return finish_graph(_decode_window(jpegs, anchors, shapes, device=decode_on, **mixed), antialias, photometric)


def build_dali(spec: PipelineSpec) -> Pipeline:
    """The built DALI graph of ``spec``: ``gpu_pipeline`` on a GPU, else
    ``crop_decode_pipeline``."""
    common = dict(
        batch_size=spec.max_batch_size,
        num_threads=spec.threads,
        device_id=spec.device_id if spec.device == "gpu" else None,
        # Depth 1: DALI's own first-run prefetch would demand ``depth`` fed batches
        # up front; the runner schedules up to ``spec.prefetch`` runs itself instead.
        prefetch_queue_depth=1,
        exec_dynamic=True,
    )
    if spec.device == "gpu":
        pipe = gpu_pipeline(antialias=spec.antialias, hw_decoder_load=spec.hw_decoder_load,
                            photometric=spec.photometric, **common)
    else:
        pipe = crop_decode_pipeline(**common)
    pipe.build()
    return pipe

"""Quantisation methods and the format names quantised checkpoints record: one home for both.

A *method* is what a user asks for (``--quant fp8``, ``quantize_model(m, "int4")``); a *format* is the
string a quantised checkpoint records, so that loading it with the wrong kernels is refused rather than
silently wrong (``fastdecode.models.quantize`` describes each format). This module imports nothing of
the package, so the model (``fastdecode.models.llama``), the quantisation transforms
(``fastdecode.models.quantize``), the loader and the exporter can all use it without an import cycle.
"""

from __future__ import annotations

from typing import Optional

#: the quantisation methods of the block projections (``quantize_model``, ``--quant``)
METHODS = ("fp8", "int4")
QUANT_METHODS = METHODS
#: the methods of the lm head (``quantize_head``, ``--quant-head``): the same two
HEAD_METHODS = METHODS

FP8_FORMAT = "fp8-w8a8-channel"
INT4_GROUP = 128
INT4_SYMMETRIC = False  # zero points: measured more accurate (fastdecode.models.quantize's docstring)
INT4_FAMILY = "int4-w4a16"  # every int4 format name starts with this


def int4_format(group_size: int = INT4_GROUP, symmetric: bool = INT4_SYMMETRIC) -> str:
    """The format name of RTN int4 weights with ``group_size`` and zero mode: ``int4-w4a16-g128-zero``."""
    return f"{INT4_FAMILY}-g{group_size}-{'sym' if symmetric else 'zero'}"


INT4_FORMAT = int4_format()
#: method -> the format string a checkpoint records
FORMATS = {"fp8": FP8_FORMAT, "int4": INT4_FORMAT}


def method_of(fmt: Optional[str]) -> Optional[str]:
    """The quant method ("fp8" / "int4") of a recorded format name, None when unquantised or unknown."""
    if fmt in (FP8_FORMAT, "fp8"):
        return "fp8"
    if isinstance(fmt, str) and (fmt == "int4" or fmt.startswith(INT4_FAMILY)):
        return "int4"
    return None


def check_head(head: Optional[str], name: str = "head") -> None:
    """Raise ValueError unless ``head`` is None or one of :data:`HEAD_METHODS`."""
    if head is not None and head not in HEAD_METHODS:
        raise ValueError(f"{name} must be one of {HEAD_METHODS} or None, got {head!r}")


__all__ = ["FORMATS", "FP8_FORMAT", "HEAD_METHODS", "INT4_FAMILY", "INT4_FORMAT", "INT4_GROUP", "INT4_SYMMETRIC",
           "METHODS", "QUANT_METHODS", "check_head", "int4_format", "method_of"]

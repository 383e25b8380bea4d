"""The committed evaluation text (public-domain Shakespeare), split into calibration and evaluation parts."""

from __future__ import annotations

from importlib import resources
from typing import Literal

TEXT_FILE = "tiny_shakespeare.txt"
EVAL_START = "FROM HAMLET, PRINCE OF DENMARK"
"""The evaluation split starts at this heading; everything before it is the calibration split."""


def eval_text(split: Literal["calib", "eval", "all"] = "eval") -> str:
    """``nybble/data/tiny_shakespeare.txt``: ``"calib"`` (sonnets, comedies; ~19 KB), ``"eval"``
    (tragedies and histories; ~28 KB, disjoint from calib) or ``"all"``."""
    text = resources.files("nybble").joinpath("data", TEXT_FILE).read_text(encoding="utf-8")
    cut = text.find(EVAL_START)
    if cut < 0:  # pragma: no cover - the committed file has the heading
        raise RuntimeError(f"{TEXT_FILE} lacks the heading {EVAL_START!r}")
    if split == "calib":
        return text[:cut]
    if split == "eval":
        return text[cut:]
    if split == "all":
        return text
    raise ValueError(f"eval_text: split must be 'calib', 'eval' or 'all', got {split!r}")


__all__ = ["eval_text"]

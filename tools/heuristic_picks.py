"""Prints every pick of the Mosaic GPU heuristics over the named shapes, so that a refactor of the cost model
can prove it changes none: run it before and after and diff the output.

    python tools/heuristic_picks.py > after.txt     # one line per (shape, M, group, offsets, scale bytes)
"""

from __future__ import annotations

import dataclasses
import sys


def picks() -> list[str]:
    from bench.arg_specs import SHAPES
    from nybble.kernels.mosaic_gpu.heuristics import heuristic_config
    from nybble.packing import padded_weight_dims

    ms = sorted({*range(1, 65), 96, 128, 256, 512, 1024, 2048, 4096})
    out = []
    for shape in SHAPES.values():
        k_pad, n_pad = padded_weight_dims(shape.k, shape.n)
        for group in (32, 64, 128, None):
            for has_offsets in (False, True):
                for scale_bytes in (2,):
                    for m in ms:
                        c = heuristic_config(
                            m, n_pad, k_pad, group, has_offsets=has_offsets, scale_bytes=scale_bytes
                        )
                        out.append(
                            f"{shape.name} M={m} g={group} offsets={has_offsets} scale_bytes={scale_bytes}: "
                            f"{sorted(dataclasses.asdict(c).items())}"
                        )
    return out


if __name__ == "__main__":
    sys.stdout.write("\n".join(picks()) + "\n")

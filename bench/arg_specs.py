"""The benchmark's arguments: named layer shapes (K, N), the M sweep, group sizes, and presets."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    """One weight of a real model: ``y (M, N) = x (M, K) @ w (K, N)``."""

    name: str
    k: int
    n: int

    def __str__(self) -> str:
        return f"{self.name} ({self.k}x{self.n})"


# Named weights, (K, N) = (in_features, out_features).
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama3-8b-qo", 4096, 4096),
        Shape("llama3-8b-kv", 4096, 1024),
        Shape("llama3-8b-gate-up", 4096, 14336),
        Shape("llama3-8b-down", 14336, 4096),
        Shape("llama3-70b-qo", 8192, 8192),
        Shape("llama3-70b-gate-up", 8192, 28672),
        Shape("llama3-70b-down", 28672, 8192),
        Shape("smollm2-135m-qo", 576, 576),
        Shape("smollm2-135m-gate-up", 576, 1536),
        Shape("smollm2-135m-down", 1536, 576),
        Shape("square-4096", 4096, 4096),
        Shape("square-8192", 8192, 8192),
    )
}

# Rows of x: decode (1..16 tokens) through prefill (4096 tokens).
M_SWEEP: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

DEFAULT_GROUP_SIZE = 128
GROUP_SIZE_CHOICES = (32, 64, 128, 256, -1)  # -1: one scale per column


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named selection of shapes and M values."""

    name: str
    shapes: tuple[str, ...]
    ms: tuple[int, ...]
    description: str
    moe: str | None = None  # the MoE points run after the dense ones (bench.moe.MOE_PRESETS), if any


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "quick",
            ("llama3-8b-qo", "llama3-8b-kv", "llama3-8b-gate-up", "llama3-8b-down", "llama3-70b-qo"),
            (1, 16, 64, 256, 1024, 4096),
            "default on a GPU: the Llama-3-8B layers and one 70B layer, decode to prefill",
        ),
        Preset(
            "full",
            tuple(SHAPES),
            M_SWEEP,
            "every named shape at every M, then every MoE point (MoE preset 'moe')",
            "moe",
        ),
        Preset(
            "check",
            (
                "llama3-8b-qo",
                "llama3-8b-gate-up",
                "llama3-8b-down",
                "llama3-70b-qo",
                "llama3-70b-down",
                "llama3-8b-kv",
                "smollm2-135m-gate-up",
                "llama3-70b-gate-up",
            ),
            (1, 16, 64, 256, 1024, 4096),
            "bench/gpu_check.sh: the layers that matter most, most important first (cut by --budget-s), "
            "then MoE points at real shapes (MoE preset 'check')",
            "check",
        ),
        Preset(
            "cpu",
            ("smollm2-135m-qo", "smollm2-135m-gate-up", "smollm2-135m-down"),
            (1, 16, 128),
            "default without a GPU: the XLA paths on the CPU at small real shapes, then a shrunk MoE layer "
            "(MoE preset 'tiny'; --moe cpu for more)",
            "tiny",
        ),
        Preset(
            "tiny",
            ("smollm2-135m-qo",),
            (1, 8),
            "smoke tests: one small shape, two M, three shrunk MoE points",
            "tiny",
        ),
        Preset(
            "moe",
            (),
            (),
            "the MoE points only: every MoE shape, gate and down, T 1..4096 (MoE preset 'moe')",
            "moe",
        ),
    )
}


def parse_group_size(value: int | str) -> int | None:
    """``--group-size``: a power of two >= 16, or -1 / 'col' for one scale per column (returns None)."""
    if str(value).lower() in ("-1", "col", "column", "per-column", "none"):
        return None
    g = int(value)
    if g < 16 or g & (g - 1):
        raise ValueError(f"group size must be a power of two >= 16 or -1 (per column), got {value}")
    return g


def group_label(group_size: int | None) -> str:
    """``g128`` or ``per-column``."""
    return "per-column" if group_size is None else f"g{group_size}"


def select_shapes(names: list[str] | tuple[str, ...]) -> list[Shape]:
    """Named shapes, or ``KxN`` literals such as ``4096x11008``."""
    out = []
    for name in names:
        if name in SHAPES:
            out.append(SHAPES[name])
            continue
        try:
            k, n = (int(v) for v in name.lower().split("x"))
        except ValueError:
            raise ValueError(
                f"unknown shape {name!r}: use one of {sorted(SHAPES)} or KxN (e.g. 4096x11008)"
            ) from None
        out.append(Shape(f"{k}x{n}", k, n))
    return out

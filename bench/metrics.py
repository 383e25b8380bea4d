"""Counting FLOPs and bytes, and turning a time into rates, roofline fractions and speedups.

Everything here is plain arithmetic on numbers, so the tests can check it exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

BF16_BYTES = 2


def matmul_flops(m: int, k: int, n: int) -> int:
    """Useful FLOPs of ``(M, K) @ (K, N)``: one multiply and one add per term (padding not counted)."""
    return 2 * m * k * n


def activation_bytes(m: int, k: int, n: int, itemsize: int = BF16_BYTES) -> int:
    """Bytes of x read (M x K) and y written (M x N)."""
    return (m * k + m * n) * itemsize


def int4_weight_bytes(
    k_pad: int, n_pad: int, num_groups: int, *, has_offsets: bool = False, scale_itemsize: int = 2
) -> int:
    """Bytes of an int4 weight as stored: packed codes, then one scale (and offset) per group and column."""
    codes = k_pad * n_pad // 2
    per_group = num_groups * n_pad * scale_itemsize
    return codes + per_group * (2 if has_offsets else 1)


def dense_weight_bytes(k: int, n: int, itemsize: int = BF16_BYTES) -> int:
    """Bytes of a dense (K, N) weight."""
    return k * n * itemsize


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Limits of the device: copy bandwidth (read + written) and the bf16 matmul rate, measured by the
    benchmark (``bench.device.measure_ceilings``) or a spec sheet's (``source`` says which)."""

    copy_bytes_per_s: float
    bf16_flops_per_s: float
    source: str = "measured"

    def roofline_s(self, flops: float, nbytes: float) -> float:
        """The floor: the larger of FLOPs over the matmul rate and bytes over the copy bandwidth."""
        return max(flops / self.bf16_flops_per_s, nbytes / self.copy_bytes_per_s)

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is bound by the matmul rate, not by memory."""
        return self.bf16_flops_per_s / self.copy_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one timed row achieved, against the ceilings."""

    tflops: float
    gbps: float
    pct_copy_bw: float
    pct_bf16: float
    roofline_us: float
    pct_roofline: float


def rates(seconds: float, flops: float, nbytes: float, ceilings: Ceilings) -> Rates:
    """TFLOP/s, effective GB/s over the bytes that must move, and percentages of the ceilings."""
    if not seconds > 0:
        raise ValueError(f"time must be positive, got {seconds}")
    roof = ceilings.roofline_s(flops, nbytes)
    return Rates(
        tflops=flops / seconds / 1e12,
        gbps=nbytes / seconds / 1e9,
        pct_copy_bw=100.0 * nbytes / seconds / ceilings.copy_bytes_per_s,
        pct_bf16=100.0 * flops / seconds / ceilings.bf16_flops_per_s,
        roofline_us=roof * 1e6,
        pct_roofline=100.0 * roof / seconds,
    )


def speedups(times: Mapping[str, float | None], of: str) -> dict[str, float]:
    """``times[peer] / times[of]`` for every other peer with a time: > 1 means ``of`` is faster."""
    mine = times.get(of)
    if mine is None or not mine > 0:
        return {}
    return {
        peer: t / mine
        for peer, t in times.items()
        if peer != of and t is not None and t > 0 and math.isfinite(t)
    }


def ideal_speedup_over_bf16(bits_per_weight: float) -> float:
    """Memory-bound ceiling of a low-bit weight over bf16: 16 / bits per weight (3.88x at 4.125)."""
    return 16.0 / bits_per_weight

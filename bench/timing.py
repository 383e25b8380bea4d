"""Device-synchronized timing: warm-up, batches of back-to-back calls, median over many samples.

One *call* runs ``ops_per_call`` operations (one per rotated input set, so caches cannot serve the weights
of the previous op). Calls are issued back to back without waiting, so the host's dispatch overlaps the
device's work, and the device is synchronized only at the end of each *sample*; a sample holds enough
calls to last ``sample_s`` seconds. The result is the median over samples of time per operation.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per operation: median, fastest and slowest sample, and how many were taken."""

    median_s: float
    min_s: float
    max_s: float
    samples: int
    ops_per_sample: int

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median: how noisy the samples were."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else float("inf")

    def as_dict(self) -> dict[str, float | int]:
        return {
            "median_us": self.median_s * 1e6,
            "min_us": self.min_s * 1e6,
            "max_us": self.max_s * 1e6,
            "samples": self.samples,
            "ops_per_sample": self.ops_per_sample,
        }


def measure(
    call: Callable[[], Any],
    sync: Callable[[Any], None],
    *,
    ops_per_call: int = 1,
    warmup: int = 2,
    sample_s: float = 0.005,
    min_samples: int = 5,
    max_samples: int = 50,
    max_time_s: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Times ``call`` (which launches ``ops_per_call`` operations); ``sync(result)`` waits for the device.

    Takes at least ``min_samples`` samples and stops after ``max_samples`` or once ``max_time_s`` is spent.
    """
    for _ in range(max(warmup, 1)):
        sync(call())
    # Calibrate: how many calls fill one sample.
    t0 = clock()
    sync(call())
    one = max(clock() - t0, 1e-7)
    calls = max(1, min(10_000, round(sample_s / one)))
    per_op: list[float] = []
    start = clock()
    while len(per_op) < max_samples:
        t0 = clock()
        out = None
        for _ in range(calls):
            out = call()
        sync(out)
        per_op.append((clock() - t0) / (calls * ops_per_call))
        if len(per_op) >= min_samples and clock() - start > max_time_s:
            break
    return Timing(
        median_s=statistics.median(per_op),
        min_s=min(per_op),
        max_s=max(per_op),
        samples=len(per_op),
        ops_per_sample=calls * ops_per_call,
    )


def host_samples(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Wall times in seconds of ``repeats`` runs of a synchronous function (which must block until its
    result is ready), after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def time_host(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of a host-side (synchronous) function, in seconds."""
    return statistics.median(host_samples(fn, repeats=repeats, warmup=warmup))

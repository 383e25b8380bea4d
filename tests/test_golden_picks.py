"""The heuristics' picks against the committed golden file (tests/fixtures/golden_picks/picks.json).

A change of the cost model or the candidates moves picks: regenerate the file with
``python tools/golden_picks.py`` and commit the diff with the X-ray of the cases that moved. The rules
the picks follow (a producer only where the pipeline refills, persistent grids where tiles outnumber the
SMs, the near-tie rule, ...) are tests of their own in tests/test_kernel_interpret.py.
"""

from __future__ import annotations

import json

from tools.golden_picks import PATH, pick, problems


def test_every_pick_matches_the_golden_file():
    saved = json.loads(PATH.read_text())["picks"]
    assert [{k: v for k, v in p.items() if k != "config"} for p in saved] == problems(), (
        "the golden file covers other problems: python tools/golden_picks.py"
    )
    changed = [
        f"K={p['k']} N={p['n']} M={p['m']} g{p['group_size']} sym={p['symmetric']}: {p['config']} -> {today}"
        for p in saved
        if (today := pick(p)) != p["config"]
    ]
    assert not changed, (
        f"{len(changed)} heuristic picks changed (regenerate with python tools/golden_picks.py after "
        f"checking them in the X-ray):\n" + "\n".join(changed[:20])
    )


def test_the_golden_file_holds_every_family():
    """The file is not degenerate: it has both kernels, both routes, K slices, split-K, producers and
    persistent grids."""
    configs = [p["config"] for p in json.loads(PATH.read_text())["picks"]]
    assert {c.get("compute_wgs", 1) for c in configs} == {1, 2}
    assert {c.get("scales_on", "weights") for c in configs} == {"accumulators", "weights"}
    assert any(c.get("slices", 1) > 1 for c in configs) and any(c.get("split_k", 1) == 8 for c in configs)
    assert any(c.get("producer") for c in configs) and any(c.get("persistent_ctas") for c in configs)


def test_with_steps_is_replace_of_the_depth():
    """The heuristics set each candidate's pipeline depth with ``TuningConfig.with_steps`` (no re-check of
    the other fields): the same config as ``dataclasses.replace``, equal and hashing alike, and the depth's
    own rule still enforced."""
    import dataclasses

    import pytest

    from nybble.kernels.mosaic_gpu.config import TuningConfig

    base = TuningConfig(tiles=1, tile_m=16, tile_k=128, split_k=2, scales_on="accumulators")
    for steps in range(2, 9):
        fast, slow = base.with_steps(steps), dataclasses.replace(base, max_concurrent_steps=steps)
        assert fast == slow and hash(fast) == hash(slow) and fast.tag == slow.tag
        assert fast.max_concurrent_steps == steps and base.max_concurrent_steps == 4
    for steps in (1, 9):
        with pytest.raises(ValueError, match=r"max_concurrent_steps=\d must be in \[2, 8\]"):
            base.with_steps(steps)

"""Expert-parallel stacked int4 weights (placeholder, filled below)."""


class ExpertShardedWeight:
    pass

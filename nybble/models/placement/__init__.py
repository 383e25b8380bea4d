"""Placing a model's weights on devices: sharding rules and ``shard`` (``shard``)."""

"""Datasets of many writers (a store per writer under one root, read as one): the layer between sampling/ and store/.

- :mod:`~her_store.datasets.marker`: the root's marker (``sharded.json``), shard names and finding the shards.
- :mod:`~her_store.datasets.shards`: :func:`open_shard`, one writer's store, created on first use, resumed after.
- :mod:`~her_store.datasets.view`: :class:`ShardedView`, every committed episode of every shard, read-only.
- :mod:`~her_store.datasets.opening`: :func:`open_store` (a writer: one store, or one writer's shard) and
  :func:`open_dataset` (a reader of a dataset of many writers), the documented ways in.
"""

"""One store's episodes written, committed, followed and read back: the layer between datasets/ and format/.

- :mod:`~her_store.store.episode_store`: :class:`EpisodeStore`, create, open and resume a store, append and read
  episodes, the dataset card.
- :mod:`~her_store.store.creation`: how a store is made (its arrays planned, its Zarr metadata and first commit
  record written) and what a create cut short leaves.
- :mod:`~her_store.store.opening`: :func:`open_or_create`, the one road to a store for writing.
- :mod:`~her_store.store.commit`: :class:`Committer`, staging, ring placement and the commit protocol.
- :mod:`~her_store.store.following`: :class:`CommitFollower`, the committed episodes a handle knows and its refresh.
- :mod:`~her_store.store.index`: the episode index (start rows, lengths, flags, checksums, cumulative lengths).
- :mod:`~her_store.store.chunk_io`: rows of an array written at commit (in place, or whole chunks through zarr).
- :mod:`~her_store.store.frame_writer`: image rows encoded as episodes are staged, frame files replaced at commit.
- :mod:`~her_store.store.step_writer`: :class:`StepWriter`, per-step adds of ``n_envs`` interleaved environments.
- :mod:`~her_store.store.episode`: :class:`Episode`, an episode's fields as a read-only mapping.
- :mod:`~her_store.store.split`: work split between the calling thread and a pool's threads (frame encoding and
  decoding).
- :mod:`~her_store.store.rows`: :class:`ChunkReader`, where rows are gathered, through one row reader per array:
  :mod:`~her_store.store.mapped_rows` (local uncompressed chunks, memory-mapped),
  :mod:`~her_store.store.cached_rows` (compressed or remote chunks through a bounded cache, ranged GETs) and
  :mod:`~her_store.store.frame_rows` (image rows from their frame files).
"""

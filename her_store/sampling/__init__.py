"""Sampling: hindsight-relabelled batches from stores, composed of small public parts that every sampler reuses.

A batch is a draw (:mod:`~her_store.sampling.draw`: which ``(episode, step)``, uniform over the committed episodes of
:mod:`~her_store.sampling.committed`), a goal choice (:mod:`~her_store.sampling.relabel`: the strategy, or a random
goal source), a gather from a row source (:mod:`~her_store.sampling.gather`: the store's ChunkReader, or a working
set's rows, :mod:`~her_store.sampling.ring_rows`), a reward recomputation (:mod:`~her_store.sampling.rewards`) and
its assembly on the device (:mod:`~her_store.sampling.batch`), with options checked once
(:mod:`~her_store.sampling.config`). :mod:`~her_store.sampling.sampler` (HerSampler, batches made ahead by
:mod:`~her_store.sampling.prefetch`), :mod:`~her_store.sampling.working_set`, :mod:`~her_store.sampling.mixture` and
:mod:`~her_store.sampling.loader` (a DataLoader dataset) compose them.
"""

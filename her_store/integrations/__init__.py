"""Integrations: the HER APIs users already know (SB3, rllte, the simple API, SB2's wrappers) over the disk store.

Each module imports its optional dependency lazily (:func:`require`) and calls only the public API of the core;
the core never imports this package. The modules:

- SB3: ``sb3`` (ZarrHerReplayBuffer), ``sb3_handle`` (its saved handle), ``sb3_relabel`` (relabelling through its
  VecEnv), ``sb3_samples`` (SB3's batches), ``sb3_infos`` (SB3's infos and the stored info keys),
  ``sb3_resources`` (its store, sampler and temporary directory), ``sb3_layout`` (SB3's arrays rebuilt from a
  store).
- rllte and the simple API: ``rllte`` (HerReplayStorage), ``simple`` (HindsightExperienceReplay), ``inputs`` (the
  conversions and checks of their arguments).
- Env wrappers: ``wrappers`` (their import path), ``flattener`` (GoalEnvFlattener), ``recorders`` (RecordEpisodes,
  RecordVectorEpisodes).
- The main job, ``her-store train``: ``train`` (the command), ``train_config`` (its options), ``train_env`` (the env),
  ``train_run_dir`` (run.json and checkpoints), ``train_loop`` (training and resuming), ``train_eval`` (the
  success rate), ``train_report`` (the summary and the dataset card), ``train_errors`` (how it stops and fails).
"""

from __future__ import annotations

from her_store.extras import require

__all__ = ["require"]

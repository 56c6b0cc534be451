"""The env wrappers' import path: :class:`GoalEnvFlattener` (SB2's goal-env flattener) and the episode recorders.

:class:`~her_store.integrations.flattener.GoalEnvFlattener` turns a goal env's Dict observation into one flat vector,
reversibly; :class:`~her_store.integrations.recorders.RecordEpisodes` (one env) and
:class:`~her_store.integrations.recorders.RecordVectorEpisodes` (a gymnasium vector env) write every finished episode
into a store, whatever policy drives the env.
"""

from __future__ import annotations

from her_store.integrations.flattener import GoalEnvFlattener
from her_store.integrations.recorders import RecordEpisodes, RecordingWarning, RecordVectorEpisodes

__all__ = ["GoalEnvFlattener", "RecordEpisodes", "RecordVectorEpisodes", "RecordingWarning"]

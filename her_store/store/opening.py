"""The one road to a store for writing: :func:`open_or_create` resumes the store at a place, or creates it.

An existing store's spaces and creation options are checked against those given; one backend is built, once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

from gymnasium import spaces

from her_store.errors import NotAStoreError, SchemaMismatchError, StoreExistsError
from her_store.format.keys import COMMIT_KEY
from her_store.format.layout import Layout
from her_store.format.schema import Schema
from her_store.storage import Backend, open_backend
from her_store.store.creation import plan_arrays
from her_store.store.episode_store import EpisodeStore

__all__ = ["OPEN_OPTIONS", "check_creation_options", "open_or_create"]

# what opening (not creating) takes
OPEN_OPTIONS = ("storage_options", "durability", "commit_interval", "lease_ttl", "priority_fn")


def open_or_create(
    path_or_url: str | os.PathLike[str] | Backend,
    observation_space: spaces.Dict | None = None,
    action_space: spaces.Space | None = None,
    **kwargs: Any,
) -> EpisodeStore:
    """The store at ``path_or_url`` opened for appending, created first if there is none (what
    :func:`her_store.open_store` does for one store).

    Parameters
    ----------
    path_or_url : str, PathLike or Backend
        The store's place.
    observation_space, action_space : gymnasium spaces, optional
        Required to create; when the store exists they must equal the stored ones (SchemaMismatchError otherwise).
    **kwargs
        Passed to :meth:`EpisodeStore.create` (capacity, info_keys, metadata, ...) or, for an existing store,
        those :meth:`EpisodeStore.open` takes (``OPEN_OPTIONS``); creation options given for an existing store must
        be the ones it was created with.

    Raises
    ------
    NotAStoreError
        No store there and no spaces to create one.
    SchemaMismatchError
        Spaces or creation options that differ from the existing store's.
    """
    backend = open_backend(path_or_url, kwargs.get("storage_options"))
    if not backend.exists(COMMIT_KEY):
        if observation_space is None or action_space is None:
            where = f"{backend} does not exist" if backend.place_exists() is False else f"{backend} holds no store"
            raise NotAStoreError(f"{where}; pass observation_space and action_space to create one")
        try:
            return EpisodeStore.create(
                backend, observation_space, action_space, **{k: v for k, v in kwargs.items() if k != "storage_options"}
            )
        except StoreExistsError:  # created meanwhile by another process: resume it
            pass
    open_kw = {k: kwargs[k] for k in OPEN_OPTIONS if k in kwargs and k != "storage_options"}
    store = EpisodeStore.open(backend, mode="a", **open_kw)
    try:
        if observation_space is not None or action_space is not None:
            given = Schema(
                observation_space if observation_space is not None else store.observation_space,
                action_space if action_space is not None else store.action_space,
                kwargs.get("info_keys", store.schema.info_spaces),
            )
            given.check_same(store.schema, store.url)
        check_creation_options(store, kwargs)
    except BaseException:
        store.close()
        raise
    return store


def check_creation_options(store: EpisodeStore, options: Mapping[str, Any]) -> None:
    """open_store on an existing store: creation options given again must be the ones it was created with."""
    if "capacity" in options and options["capacity"] != store.capacity:
        raise SchemaMismatchError(
            f"{store.url} was created with capacity={store.capacity}, got capacity={options['capacity']!r}; a store's "
            "capacity is fixed at creation (copy its episodes into a new store to change it)"
        )
    if "chunk_rows" in options or "compressors" in options:
        layout, codecs = plan_arrays(
            store.backend, store.schema, store.capacity, options.get("chunk_rows"), options.get("compressors")
        )
        stored = {spec.columns[0][0]: spec for spec in store.layout.arrays if spec.compressed}
        if "compressors" in options and set(codecs) != set(stored):
            raise SchemaMismatchError(
                f"{store.url} stores fields {sorted(stored)} compressed, the compressors given compress "
                f"{sorted(codecs)}; compressors are fixed at creation"
            )
        if options.get("chunk_rows") is not None:
            want = Layout.build(store.schema, set(stored), int(options["chunk_rows"]))
            if want.to_json() != store.layout.to_json():
                raise SchemaMismatchError(
                    f"{store.url} was created with arrays {store.layout.describe()}, chunk_rows="
                    f"{options['chunk_rows']} makes {want.describe()}; chunk_rows is fixed at creation"
                )
        for name, spec in stored.items():
            if "compressors" in options:
                have = [cast(Any, c).to_dict() for c in store.zarr_array(spec.path).compressors]
                want_codecs = [c.to_dict() for c in codecs[name]]
                if have != want_codecs:
                    raise SchemaMismatchError(
                        f"{store.url}: field {name!r} is stored with {have}, got compressors {want_codecs}; "
                        "compressors are fixed at creation"
                    )
    given = options.get("metadata")
    if given:
        card = store.metadata
        differ = sorted(k for k in given if card.get(k, object()) != given[k])
        if differ:
            raise SchemaMismatchError(
                f"{store.url}: metadata {differ} differ from the store's card ({ {k: card.get(k) for k in differ} } "
                f"stored, { {k: given[k] for k in differ} } given); change the card with store.update_metadata(...)"
            )

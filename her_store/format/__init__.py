"""The on-disk contract in code (FORMAT.md is its prose): the layer between store/ and storage/.

- :mod:`~her_store.format.keys`: the names of a store's keys (its fixed files, its chunk keys).
- :mod:`~her_store.format.layout`: array paths, packing of fields into arrays, index columns, root attributes and
  their checks (``FORMAT_VERSION``).
- :mod:`~her_store.format.commit_record`: :class:`Commit`, the commit record ``commit.json``, checked.
- :mod:`~her_store.format.schema`: a store's fields from gymnasium spaces, spaces to and from JSON, episodes checked.
- :mod:`~her_store.format.card`: the dataset card's fields and their checks (``CARD_FIELDS``).
- :mod:`~her_store.format.frames`: the frame codec of image rows (frame files of one frame per inner chunk).
- :mod:`~her_store.format.jpeg`: the lossy JPEG codec of image rows, ``her_store.jpeg``, off by default.
"""

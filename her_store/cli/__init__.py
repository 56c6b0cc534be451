"""The ``her-store`` command: the top layer, above integrations/; its command table and command lines.

- :mod:`~her_store.cli.main`: :func:`main`, the command table (a module per command, imported when it runs) and
  ``demo``; ``inspect``, ``card``, ``plot``, ``copy`` and ``pack`` are run by their :mod:`her_store.ops` modules,
  ``train`` by :mod:`her_store.integrations.train`.
- :mod:`~her_store.cli.verify`: ``her-store verify [--repair]`` (:mod:`her_store.ops.verify`,
  :mod:`her_store.ops.repair`).
- :mod:`~her_store.cli.export`: ``her-store export`` (:mod:`her_store.interop.export`).
- :mod:`~her_store.cli.import_`: ``her-store import`` (:mod:`her_store.interop.import_`).
- :mod:`~her_store.cli.__main__`: ``python -m her_store.cli``, the same command.
"""

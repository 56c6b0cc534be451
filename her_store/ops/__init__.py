"""Tools on whole stores (verify and repair, copy, pack, inspect, plot): the layer between interop/ and sampling/.

Each command module declares its ``her-store`` arguments (``add_arguments``) and runs them (``run``).

- :mod:`~her_store.ops.verify`: :func:`verify`, every invariant of FORMAT.md and every live episode's crc32.
- :mod:`~her_store.ops.report`: :class:`Report`, what verify found (problems, the episodes they affect).
- :mod:`~her_store.ops.repair`: :func:`repair`, drops what verify finds damaged, with a new commit.
- :mod:`~her_store.ops.repair_plan`: the plan a repair leaves beside a store, so that the next one finishes it.
- :mod:`~her_store.ops.copy`: :func:`copy_store`, one commit of a store between local disk and object storage.
- :mod:`~her_store.ops.pack`: :func:`pack_store`, a store as one zip file that opens read-only in place.
- :mod:`~her_store.ops.inspect`: what a store holds (``her-store inspect``) and its dataset card (``her-store card``).
- :mod:`~her_store.ops.plot`: one PNG of success, return, lengths and final goals.
- :mod:`~her_store.ops.selection`: episode selections as users type them (``--episodes 0:100,250,-10:``).
"""

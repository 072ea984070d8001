"""Parallel training helpers: FSDP2/HSDP sharding (:mod:`.fsdp`), shard-wise weight loading
(:mod:`.pretrained`) and Ulysses sequence parallelism (:mod:`.ulysses`).

This ``__init__`` imports nothing on purpose: :mod:`.fsdp` and :mod:`.pretrained` sit in the layer of
``models`` (whose ``configure_model`` calls them), while other modules of this package sit above
``models``; importing them here would pull a higher layer into every import of the lower ones.
"""

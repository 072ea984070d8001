"""Parallel training helpers: Ulysses sequence parallelism (:mod:`.ulysses`).

This ``__init__`` imports nothing on purpose, so that modules of this package may sit in different
layers (tests/test_architecture.py) without one pulling another into every import.
"""

# Registers ${adaptiveload.select:...}, the resolver these configs use (composing through
# `lightning_adaptiveload.conf` then resolves without importing the command line first).
import lightning_adaptiveload.cli  # noqa: F401

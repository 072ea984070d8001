"""Adapters for models from other libraries.

Each submodule imports its library; this package imports none of them, so
``import lightning_adaptiveload`` works without them. Use
``from lightning_adaptiveload.integrations.diffusers import DiffusersWanModule, patch_wan_transformer``
(needs ``pip install lightning-adaptiveload[diffusers]``).
"""

"""Data sources: synthetic mixed-shape latents, manifest-backed datasets, media decoding, collation."""

from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.manifest import ManifestDataset, ManifestReport, read_manifest_shapes
from lightning_adaptiveload.data.media import CorruptSampleError, PatchPoolEncoder
from lightning_adaptiveload.data.mixtures import MIXTURES, get_mixture
from lightning_adaptiveload.data.shards import ShardedLatentDataset, ShardReport, ShardWriter, write_index
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

__all__ = [
    "MIXTURES",
    "CorruptSampleError",
    "ManifestDataset",
    "ManifestReport",
    "PatchPoolEncoder",
    "ShardReport",
    "ShardWriter",
    "ShardedLatentDataset",
    "SyntheticMixedDataset",
    "collate_batch",
    "get_mixture",
    "read_manifest_shapes",
    "write_index",
]

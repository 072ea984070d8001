"""Media → real Wan 2.1 VAE / umT5 encoders → tar shards + shape index (``adaptiveload-prepare``)."""

from lightning_adaptiveload.prepare.buckets import Bucket, BucketRules, SkipSample
from lightning_adaptiveload.prepare.encoders import UMT5TextEncoder, WanVaeEncoder, caption_hash
from lightning_adaptiveload.prepare.inputs import InputItem, probe, read_inputs
from lightning_adaptiveload.prepare.pipeline import PrepareError, Preparer, PrepareResult, format_summary

__all__ = [
    "Bucket",
    "BucketRules",
    "InputItem",
    "PrepareError",
    "PrepareResult",
    "Preparer",
    "SkipSample",
    "UMT5TextEncoder",
    "WanVaeEncoder",
    "caption_hash",
    "format_summary",
    "probe",
    "read_inputs",
]

import pytest
import torch

from lightning_adaptiveload.data.collate import collate_batch


def _sample(index, latent_shape=(4, 1, 2, 3), context_shape=(5, 6)):
    return {
        "latents": torch.full(latent_shape, float(index)),
        "context": torch.full(context_shape, -float(index)),
        "index": index,
    }


def test_collate_stacks_in_order():
    batch = collate_batch([_sample(7), _sample(2), _sample(9)])
    assert batch["latents"].shape == (3, 4, 1, 2, 3)
    assert batch["context"].shape == (3, 5, 6)
    assert batch["index"].dtype == torch.long
    assert batch["index"].tolist() == [7, 2, 9]
    assert batch["latents"][:, 0, 0, 0, 0].tolist() == [7.0, 2.0, 9.0]
    assert batch["context"][:, 0, 0].tolist() == [-7.0, -2.0, -9.0]


def test_collate_latent_mismatch_names_indices_and_shapes():
    samples = [_sample(3), _sample(11, latent_shape=(4, 5, 2, 3)), _sample(12)]
    with pytest.raises(ValueError) as err:
        collate_batch(samples)
    msg = str(err.value)
    assert "'latents' shapes differ" in msg
    assert "[4, 1, 2, 3] at dataset indices [3, 12]" in msg
    assert "[4, 5, 2, 3] at dataset indices [11]" in msg


def test_collate_context_mismatch():
    with pytest.raises(
        ValueError, match=r"'context' shapes differ.*\[5, 6\] at dataset indices \[0\]; \[7, 6\]"
    ):
        collate_batch([_sample(0), _sample(1, context_shape=(7, 6))])


def test_collate_empty_and_missing_key():
    with pytest.raises(ValueError, match="got no samples"):
        collate_batch([])
    bad = _sample(0)
    del bad["context"]
    with pytest.raises(ValueError, match=r"sample 1 has no \['context'\]"):
        collate_batch([_sample(1), bad])

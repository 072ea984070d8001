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


def test_collate_keeps_every_key():
    samples = [
        {**_sample(i), "context_mask": torch.tensor([1, 1, 0, 0, 0]) + i, "pooled": torch.full((3,), float(i)),
         "caption": f"clip {i}", "fps": 24}
        for i in (4, 8)
    ]
    batch = collate_batch(samples)
    assert set(batch) == {"latents", "context", "index", "context_mask", "pooled", "caption", "fps"}
    assert batch["context_mask"].tolist() == [[5, 5, 4, 4, 4], [9, 9, 8, 8, 8]]
    assert batch["pooled"].shape == (2, 3) and batch["pooled"][:, 0].tolist() == [4.0, 8.0]
    assert batch["caption"] == ["clip 4", "clip 8"]
    assert batch["fps"] == [24, 24]


def test_collate_refuses_a_tensor_key_of_two_shapes_in_one_line():
    samples = [{**_sample(0), "context_mask": torch.ones(5)}, {**_sample(1), "context_mask": torch.ones(7)}]
    with pytest.raises(ValueError) as err:
        collate_batch(samples)
    msg = str(err.value)
    assert "\n" not in msg
    assert "'context_mask' shapes differ" in msg and "[5] at dataset indices [0]; [7] at dataset indices [1]" in msg
    assert "Pad 'context_mask' to one stated length" in msg and "collate_fn" in msg


def test_collate_refuses_a_key_missing_from_one_sample():
    samples = [{**_sample(0), "pooled": torch.ones(3)}, _sample(1)]
    with pytest.raises(ValueError, match=r"sample 1 has no \['pooled'\]"):
        collate_batch(samples)

"""Encoder loading errors name the option, the value and the fix."""

from __future__ import annotations

import pytest

from lightning_adaptiveload.prepare.encoders import load_pretrained


def _hub_unreachable(path, subfolder=None, **kwargs):
    # What diffusers / transformers raise when the hub cannot be reached for a name that is no local folder.
    raise OSError(f"{path} does not appear to have a file named config.json.")


def test_an_unreachable_hub_says_pass_a_local_directory():
    with pytest.raises(ValueError) as info:
        load_pretrained(_hub_unreachable, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "vae", "--vae")
    message = str(info.value)
    assert message.startswith("--vae Wan-AI/Wan2.1-T2V-1.3B-Diffusers: not a local directory, and the model hub did "
                              "not provide it (Wan-AI/Wan2.1-T2V-1.3B-Diffusers does not appear to have a file named "
                              "config.json.). Pass a local directory")
    assert "\n" not in message


def test_a_local_directory_without_the_model_names_the_folder_to_pass(tmp_path):
    with pytest.raises(ValueError, match=rf"^--text-encoder {tmp_path}: cannot load it from this directory \(.*\)\. "
                                         r"Pass the directory of a Diffusers Wan 2.1 repo \(with a `text_encoder/`"):
        load_pretrained(_hub_unreachable, str(tmp_path), "text_encoder", "--text-encoder")


def test_the_subfolder_of_a_diffusers_repo_is_tried_second():
    calls = []

    def loader(path, subfolder=None, **kwargs):
        calls.append(subfolder)
        if subfolder is None:
            raise OSError("no config.json")
        return ("loaded", kwargs)

    assert load_pretrained(loader, "repo", "vae", "--vae", torch_dtype="x") == ("loaded", {"torch_dtype": "x"})
    assert calls == [None, "vae"]


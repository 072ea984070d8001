"""Encoder loading errors name the option, the value and the fix."""

from __future__ import annotations

import time

import pytest

from lightning_adaptiveload.prepare import encoders
from lightning_adaptiveload.prepare.encoders import load_pretrained


@pytest.fixture(autouse=True)
def _hub_answers(request, monkeypatch):
    """The hub counts as reachable (the loaders below fake its answers), except in the offline tests."""
    check = encoders.hub_unreachable
    if "offline" not in request.node.name:
        monkeypatch.setattr(encoders, "hub_unreachable", lambda: None)
    yield
    check.cache_clear()  # its answer is cached per process


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


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "HF_ENDPOINT"])
def test_offline_or_unreachable_hub_fails_at_once_in_one_line(how, tmp_path, monkeypatch, capsys):
    # No network access: HF_HUB_OFFLINE=1, or an endpoint nothing listens on. Before the check this took
    # 60-116 s of hub retries (12 retry lines) before its error.
    from huggingface_hub import constants
    from PIL import Image

    from lightning_adaptiveload.cli.prepare import main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", how == "HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    encoders.hub_unreachable.cache_clear()
    (tmp_path / "media").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "media" / "a.png")
    (tmp_path / "media" / "a.txt").write_text("a cat")
    start = time.perf_counter()
    rc = main([str(tmp_path / "media"), str(tmp_path / "out"), "--vae", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
               "--text-encoder", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--buckets", "tiny", "--no-progress"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert rc == 1 and elapsed < 30, (elapsed, err)
    reason = "HF_HUB_OFFLINE is set" if how == "HF_HUB_OFFLINE" else "http://127.0.0.1:9: "
    assert err.splitlines() == [err.strip()] and err.startswith(
        "adaptiveload-prepare: --vae Wan-AI/Wan2.1-T2V-1.3B-Diffusers: not a local directory nor in the hub cache, "
        f"and the model hub is not reachable ({reason}")
    assert "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir" in err and "Retrying" not in err

import os
import sys
from pathlib import Path

import pytest
import torch

# Scripts the tests launch in subprocesses (and media writers they share) live in tests/helpers/; the tests
# also import their constants, so the folder is importable.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolate_distributed_state():
    """Undo what an in-process DDP run leaves behind: its environment variables and process group.

    Lightning exports MASTER_ADDR / MASTER_PORT / LOCAL_RANK / WORLD_SIZE ... into os.environ when it
    sets up a distributed strategy; a later subprocess that inherits them believes it was launched
    externally and waits for peers that never come (or binds a port still in use).
    """
    env = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(autouse=True)
def _isolate_deterministic_mode():
    """Undo torch's deterministic mode where a test turned it on (``Trainer(deterministic=True)`` sets it for
    the process and leaves it set). Left on, every later ``torch.empty`` fills its memory (torch's
    ``fill_uninitialized_memory``), and tests that count the kernels of a step see fills that are not theirs."""
    state = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = state[2], state[3]

import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_adaptiveload.strategies import SameStreamDDPStrategy, ddp_strategy


def test_ddp_wraps_the_model_on_the_current_stream(monkeypatch):
    """Lightning builds DDP under a new CUDA stream, which leaves every parameter's AccumulateGrad on it
    (a cross-stream wait per parameter each backward); the project's DDP wraps on the current stream."""
    strategy = ddp_strategy()
    assert isinstance(strategy, SameStreamDDPStrategy) and isinstance(strategy, DDPStrategy)
    seen = {}

    class FakeDDP:
        def __init__(self, module, device_ids, **kwargs):
            seen.update(module=module, device_ids=device_ids, kwargs=kwargs)

    def no_side_stream(*args, **kwargs):
        raise AssertionError("DDP was built under a new CUDA stream")

    monkeypatch.setattr(torch.cuda, "Stream", no_side_stream)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    monkeypatch.setattr(SameStreamDDPStrategy, "determine_ddp_device_ids", lambda self: [0])  # as on a GPU
    model = torch.nn.Linear(2, 2)
    assert isinstance(strategy._setup_model(model), FakeDDP)
    assert seen["module"] is model and seen["device_ids"] == [0]
    assert seen["kwargs"]["gradient_as_bucket_view"] and seen["kwargs"]["find_unused_parameters"] is False

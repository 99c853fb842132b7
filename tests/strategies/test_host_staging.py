"""The host copy an asynchronous save writes from: a point-in-time copy, in buffers reused by the next save."""

import torch

from lightning_llm.strategies.host_staging import HostCopy


def _checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": step,
            "hyper_parameters": {"lr": 0.1, "layers": [1, 2]}}


def _train_step(model, optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_copy_is_point_in_time_and_reuses_its_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    copy = HostCopy()

    first_ckpt = _checkpoint(model, optimizer, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    first = copy(first_ckpt)
    _train_step(model, optimizer)  # training changes the live tensors in place
    for key, value in expected.items():
        assert torch.equal(first["state_dict"][key], value), key
        assert not torch.equal(model.state_dict()[key], value), key  # the step really changed it
    moments = first["optimizer_states"][0]["state"][0]["exp_avg"]
    assert moments.data_ptr() != optimizer.state[model[0].weight]["exp_avg"].data_ptr()
    assert first["hyper_parameters"] == first_ckpt["hyper_parameters"] and first["global_step"] == 1

    second = copy(_checkpoint(model, optimizer, 2))
    for key, value in model.state_dict().items():
        assert torch.equal(second["state_dict"][key], value), key
        # the first save's host buffer again (its write has finished by now): nothing allocated, the stall
        # is the copy alone
        assert second["state_dict"][key].data_ptr() == first["state_dict"][key].data_ptr(), key

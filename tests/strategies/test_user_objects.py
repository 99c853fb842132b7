"""The objects a user hands the Trainer stay theirs under LLMParallelStrategy (docs/strategy.md, "Your objects").

The GradScaler passed in ``MixedPrecision("16-mixed", ..., scaler=my_scaler)`` is the one that scales: under tp2, pp2
and ZeRO-3 on 2 ranks, with ``init_scale=2**24`` so the first steps overflow and the scale halves, a callback reading
``my_scaler.get_scale()`` after every step sees the run's scale, and the precision plugin holds that very object.
Before, the strategy trained with a copy: ``my_scaler`` stayed at its initial scale while the run's went down.
A CheckpointIO that sharded saves do not use is said once.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_llm.parallel.grad_scaler import DistributedGradScaler, distributed_in_place
from lightning_llm.testing import run_distributed
from tests.strategies._parity import train

INIT_SCALE = 2.0**24  # fp16 overflows at first: the scale must come down
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, 1),
    "pp2": ({"pipeline_parallel_size": 2, "num_microbatches": 2}, 1),
    "zero3": ({"zero_stage": 3}, 2),
}


class ReadsTheUsersScaler(L.Callback):
    """What a user's logging callback does: read the scaler they passed, and the run's, after every step."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler, self.seen = scaler, []

    def on_train_batch_end(self, trainer, *args) -> None:
        plugin = trainer.precision_plugin
        self.seen.append((self.scaler.get_scale(), plugin.scaler.get_scale(), plugin.scaler is self.scaler))


def _under_layouts() -> dict | None:
    from lightning_llm.strategies import LLMParallelStrategy

    results = {}
    for label, (kwargs, dp) in LAYOUTS.items():
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        reader = ReadsTheUsersScaler(scaler)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        train(
            "reference", LLMParallelStrategy(**kwargs), devices=2, dp=dp, plugins=[plugin], callbacks=[reader], steps=4
        )
        results[label] = (reader.seen, scaler.get_scale())
    return results if dist.get_rank() == 0 else None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_users_grad_scaler_reports_the_runs_scale_under_every_layout():
    results = run_distributed(_under_layouts, 2, timeout=280)[0]
    for label, (seen, final) in results.items():
        assert all(same for _, _, same in seen), f"{label}: the plugin scales with a copy of the user's scaler"
        assert [mine for mine, _, _ in seen] == [run for _, run, _ in seen], label
        assert final == seen[-1][1] < INIT_SCALE, f"{label}: the scale never came down ({seen})"


def test_a_subclassed_scaler_keeps_its_class_and_state():
    class MyScaler(torch.amp.GradScaler):
        def describe(self) -> str:
            return f"scale {self.get_scale()}"

    scaler = MyScaler("cpu", init_scale=1024.0)
    assert distributed_in_place(scaler) is scaler
    assert isinstance(scaler, MyScaler) and isinstance(scaler, DistributedGradScaler)
    assert scaler.describe() == "scale 1024.0" and type(scaler).__name__ == "DistributedMyScaler"
    plain = torch.amp.GradScaler("cpu")
    assert type(distributed_in_place(plain)) is DistributedGradScaler


def test_a_checkpoint_io_sharded_saves_do_not_use_is_said_once():
    from lightning_llm.strategies.sharded_checkpoints import ShardedCheckpoints

    class MyIO(TorchCheckpointIO):
        pass

    with pytest.warns(UserWarning, match=r"your checkpoint_io \(MyIO\) is not used for saves"):
        ShardedCheckpoints(distributed=True).check_checkpoint_io(MyIO())
    ShardedCheckpoints(distributed=False).check_checkpoint_io(MyIO())  # a full-file save goes through it: silent

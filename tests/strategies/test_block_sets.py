"""Models without a container of blocks (Lightning's test models, a plain MLP) are sharded, not refused.

Oracle: the same model trained in one process (same shuffled order as Lightning's DistributedSampler gives two
ranks); per-step losses and every parameter within 1e-5. The units themselves are checked by hand: which
modules became FSDP units, and the names the search returns for models written out here.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_llm.modeling.blocks import BlockSet, find_blocks
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, fit_recorded

STEPS, BATCH = 4, 8


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class MLPModule(L.LightningModule):
    """Lightning's ModelParallelStrategy test model: three Linear layers, no block list."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = FeedForward()

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.model(batch), batch.flip(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class OneLayer(MLPModule):
    """Lightning's BoringModel shape: one Linear layer straight on the LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        del self.model
        self.layer = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch), batch.flip(-1))


def test_units_of_models_without_a_block_container():
    name, units = find_blocks(MLPModule())
    assert (name, units.names) == ("", ["model.w1", "model.w2", "model.w3"])
    assert find_blocks(OneLayer())[1].names == ["layer"]
    model = MLPModule()
    name, chosen = find_blocks(model, ["model.w3", "model.w1"])
    assert (name, chosen.names) == ("", ["model.w3", "model.w1"])
    assert chosen[0] is model.model.w3 and chosen[1] is model.model.w1
    picked = find_blocks(model, lambda n, m: isinstance(m, nn.Linear) and m.out_features == 64)[1]
    assert picked.names == ["model.w1", "model.w2"]
    # The units are not registered in the model: its state dict is unchanged.
    assert list(model.state_dict()) == [
        "model.w1.weight",
        "model.w1.bias",
        "model.w2.weight",
        "model.w2.bias",
        "model.w3.weight",
        "model.w3.bias",
    ]


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        (["model.w9"], "name no submodule"),
        (["model", "model.w1"], "inside other listed blocks"),
        (lambda n, m: False, "chose no module"),
    ],
)
def test_bad_block_lists_are_refused_naming_the_fix(blocks, message):
    with pytest.raises(ValueError, match=message):
        find_blocks(MLPModule(), blocks)


def _data(single: bool) -> torch.utils.data.DataLoader:
    # Two ranks read 8 samples each per step; one process reads the same 16, in the order Lightning's shuffling
    # DistributedSampler (seed 0) deals them out.
    inputs = torch.randn(STEPS * 2 * BATCH, 16, 32, generator=torch.Generator().manual_seed(1))
    sampler = DistributedSampler(inputs, num_replicas=1, rank=0, shuffle=True) if single else None
    return torch.utils.data.DataLoader(inputs, batch_size=2 * BATCH if single else BATCH, sampler=sampler)


def _fit(module, strategy="auto", devices=1):
    return fit_recorded(module, _data(single=devices == 1), strategy=strategy, devices=devices, max_steps=STEPS)[1]


def _units(module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]


LAYOUTS = {
    "MLP, ZeRO-3 (default)": (MLPModule, {}),
    "one layer, ZeRO-3": (OneLayer, {}),
    "MLP, blocks=list, ZeRO-2, full AC": (
        MLPModule,
        {"blocks": ["model.w1", "model.w2"], "zero_stage": 2, "activation_checkpointing": "full"},
    ),
    "MLP, blocks=callable, ZeRO-1": (MLPModule, {"blocks": lambda n, m: n.endswith("w3"), "zero_stage": 1}),
}
UNITS = {
    "MLP, ZeRO-3 (default)": ["model", "model.w1", "model.w2", "model.w3"],
    "one layer, ZeRO-3": ["layer"],
    "MLP, blocks=list, ZeRO-2, full AC": ["model", "model.w1", "model.w2"],
    "MLP, blocks=callable, ZeRO-1": ["model", "model.w3"],
}


def _runs():
    import torch.distributed as dist

    from lightning_llm.strategies import LLMParallelStrategy

    results = {}
    for label, (cls, kwargs) in LAYOUTS.items():
        module = cls()
        results[label] = (*_fit(module, LLMParallelStrategy(**kwargs), devices=2), _units(module))
    try:
        _fit(MLPModule(), LLMParallelStrategy(tensor_parallel_size=2), devices=2)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return (results, refusal) if dist.get_rank() == 0 else None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_models_without_a_block_container_train_as_one_process_under_every_zero_stage():
    results, refusal = run_distributed(_runs, 2, timeout=280)[0]
    for label, (cls, _) in LAYOUTS.items():
        losses, state, units = results[label]
        assert units == UNITS[label], label
        assert_parity((losses, state), _fit(cls()), label, rtol=1e-5, loss_rtol=1e-5)
    assert refusal is not None and "tensor_parallel_size=2 needs the model's transformer blocks" in refusal
    assert isinstance(find_blocks(MLPModule())[1], BlockSet)


def test_weights_tied_across_units_are_refused_before_sharding():
    from lightning_llm.parallel.parallelize import refuse_ties_across_units

    model = nn.Module()
    model.embed, model.body, model.head = nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False)
    model.head.weight = model.embed.weight
    _, units = find_blocks(model)
    assert units.names == ["embed", "body", "head"]
    tied = r"\['embed.weight', 'head.weight'\] are one tensor held by two of the units"
    with pytest.raises(ValueError, match=tied):
        refuse_ties_across_units(model, units)
    with pytest.raises(ValueError, match=tied):  # the two roots left beside the one block
        refuse_ties_across_units(model, find_blocks(model, ["body"])[1])
    wrapped = nn.Module()
    wrapped.net = model
    refuse_ties_across_units(wrapped, find_blocks(wrapped, ["net.body"])[1])  # one root, "net", holds both

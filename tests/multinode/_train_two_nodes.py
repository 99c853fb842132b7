"""Run by ``torchrun`` on each of two "nodes": dp2 x tp2 over 2 nodes x 2 processes; rank 0 saves the outcome."""

import sys

import lightning as L
import torch
import torch.distributed as dist

from lightning_llm.contract import contract_of
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer
from tests.strategies._parity import GLOBAL_BATCH, STEPS, GlobalLoss, data, full_state, make_model


class Layout(L.Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        self.layout = contract_of(trainer).layout.as_dict()


def main(out: str) -> None:
    model, losses, layout = make_model("reference"), GlobalLoss(), Layout()
    trainer = cpu_trainer(
        num_nodes=2,
        devices=2,
        strategy=LLMParallelStrategy(tensor_parallel_size=2),
        max_steps=STEPS,
        gradient_clip_val=0.5,
        callbacks=[losses, layout],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data(GLOBAL_BATCH // 2))
    params = full_state(model)
    # Parameters replicated inside each tensor-parallel pair (norm weights) must be bit-identical on both.
    local = {name: p.to_local() if hasattr(p, "to_local") else p for name, p in model.named_parameters()}
    norms = {name: t.detach().clone() for name, t in local.items() if "norm" in name}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, norms)
    if dist.get_rank() == 0:
        torch.save({"losses": losses.losses, "params": params, "layout": layout.layout, "norms": gathered}, out)


if __name__ == "__main__":
    main(sys.argv[1])

"""Rank functions for tests/parallel/test_seeding.py (spawned: they must be importable module-level functions)."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import lightning_llm.parallel.seeding as seeding
import lightning_llm.strategies.global_batch as global_batch
from lightning_llm.parallel.devices import min_over_ranks
from lightning_llm.parallel.init.materialize import check_same_rng_state
from lightning_llm.strategies.zero_auto import planning_inputs
from lightning_llm.testing import cpu_trainer
from tests.parallel._init_layouts import CONFIG, Capture, gathered_parameters


def _capture_info(module) -> list[str]:
    lines: list[str] = []
    module.rank_zero_info = lambda message, *args, **kwargs: lines.append(str(message))
    return lines


def min_memory() -> dict:
    """Rank r reads (r + 1) GiB (+ r bytes): every rank must get rank 0's, the smallest."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = SimpleNamespace(datamodule=None)  # micro-batch shape given, so no batch is read
    inputs = planning_inputs(trainer, torch.device("cpu"), (rank + 1) * 2**30 + rank, 2, 16)
    return {"min": min_over_ranks(1000 - 7 * rank), "planned": inputs["device_memory"]}


def agree(seeds: list[int]) -> dict:
    """Seed rank r with ``seeds[r]``, agree, and report the seed and the generators' states."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(seeds[rank])
    before = torch.get_rng_state().clone()
    lines = _capture_info(seeding)
    try:  # what materialize would have said before the ranks agreed
        check_same_rng_state()
        refused = None
    except RuntimeError as error:
        refused = str(error)
    seed = seeding.agree_on_seed()
    check_same_rng_state()  # agreed: materialize goes on
    return {
        "seed": seed,
        "before": before,
        "torch": torch.get_rng_state().clone(),
        "numpy": np.random.get_state()[1].copy(),
        "python": random.getstate(),
        "lines": lines,
        "refused": refused,
    }


def unseeded_fit() -> dict:
    """Each rank seeds differently on purpose, builds CausalLM in configure_model (meta), fits 2 steps at ZeRO 0."""
    from lightning_llm.data import LLMDataModule
    from lightning_llm.models import CausalLM
    from lightning_llm.strategies import LLMParallelStrategy

    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)
    seeding_lines, setup_lines = _capture_info(seeding), _capture_info(global_batch)
    module, capture = CausalLM(CONFIG), Capture()
    strategy = LLMParallelStrategy(zero_stage=0)
    trainer = cpu_trainer(
        devices=2,
        strategy=strategy,
        max_steps=2,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[capture],
    )
    trainer.fit(module, LLMDataModule(num_tokens=4000, seq_len=16, batch_size=4, seed=0))
    local = {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()
    }
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    final = gathered_parameters(module)
    return {
        "seed": strategy.run_state.agreed_seed,
        "initial": capture.params,
        "per_rank": parts,
        "final": final,
        "global_step": trainer.global_step,
        "seeding_lines": seeding_lines,
        "setup_lines": setup_lines,
    }

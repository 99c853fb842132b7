"""One zoo cell: train a model under a layout on this rank; many models share one process group.

Data is a plain ``DataLoader`` over a token tensor (Lightning adds the distributed sampler), so the
strategy learns the micro-batch shape from the batches themselves. Every rank returns its full
parameters; rank 0 merges them and lists the parameters whose copies differ between ranks.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_llm.testing import cpu_trainer
from tests.strategies._parity import GlobalLoss
from tests.zoo._models import VOCAB, ZooLM

STEPS = 4
GLOBAL_BATCH = 4
SEQ_LEN = 16

LAYOUTS = {
    "dp2_zero3": (2, {"zero_stage": 3}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    # zero_stage="auto" plans each tp rank's activations from the dataflow (one data-parallel rank: no ZeRO to pick)
    "tp2_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True, "zero_stage": "auto"}),
    "pp2": (2, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
    "dp2xtp2": (4, {"tensor_parallel_size": 2, "zero_stage": 3}),
    "ac_selective": (2, {"zero_stage": 3, "activation_checkpointing": "selective"}),
    "ac_full": (2, {"zero_stage": 3, "activation_checkpointing": "full"}),
    "zero_auto": (2, {"zero_stage": "auto"}),
}
ACCUMULATE: dict[str, int] = {}  # layout -> micro-batches per step (each rank's batch split so), where not 1


# (model, layout) -> the largest relative per-step loss difference, or "x"; printed by conftest after the run.
TABLE: dict = {}


def table_lines() -> list[str]:
    """The model x layout table of TABLE, for the terminal summary."""
    from tests.zoo._models import MODELS

    layouts = [layout for layout in LAYOUTS if any(key[1] == layout for key in TABLE)]
    lines = [
        "model zoo: max relative per-step loss difference vs one process (x: fails)",
        f"{'model':<15}" + "".join(f"{layout:>14}" for layout in layouts),
    ]
    for name in MODELS:
        cells = [TABLE.get((name, layout), "") for layout in layouts]
        lines.append(f"{name:<15}" + "".join(f"{c:>14.1e}" if isinstance(c, float) else f"{c:>14}" for c in cells))
    return lines


def tokens(steps: int = STEPS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def _local_state(model) -> dict[str, torch.Tensor]:
    # Every rank gets whole tensors; a parameter replicated over TP comes back as this rank's own copy.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def held_shares(model) -> dict[str, float]:
    """The share of the attention and of the expert parameters this rank holds: local shard elements / global
    elements, read off the parameters themselves (attention: under a module named ``*attn*``/``*attention*``)."""
    groups: dict[str, list] = {"attention": [], "experts": []}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if any("attn" in part or "attention" in part for part in parts):
            groups["attention"].append(param)
        if "experts" in parts:
            groups["experts"].append(param)
    local = lambda p: p.to_local().numel() if isinstance(p, DTensor) else p.numel()  # noqa: E731
    totals = {k: sum(p.numel() for p in ps) for k, ps in groups.items()}
    totals["experts"] += _remote_expert_elements(model)
    return {k: sum(map(local, ps)) / totals[k] for k, ps in groups.items() if ps}


def _remote_expert_elements(model) -> int:
    """The elements of the experts another EP rank holds (a ModuleList's ``RemoteExpert`` entries), each the size
    of an expert this rank holds in the same list: they belong to the whole the shares are taken of."""
    from lightning_llm.parallel.ep.expert_list import RemoteExpert

    count = 0
    for module in model.modules():
        entries = list(module.children())  # not iter(module): a pipeline stage's block list is a guarded list
        if isinstance(module, torch.nn.ModuleList) and any(isinstance(m, RemoteExpert) for m in entries):
            held = next(m for m in entries if not isinstance(m, RemoteExpert))
            size = sum(p.numel() for p in held.parameters())
            count += size * sum(isinstance(m, RemoteExpert) for m in entries)
    return count


def train(
    name: str,
    strategy=None,
    devices: int = 1,
    dp: int = 1,
    gradient_clip_val: float | None = None,
    steps: int = STEPS,
    accumulate: int = 1,
):
    """(per-step global losses, every parameter merged, names whose copies differ between ranks, planner inputs,
    the largest share of attention / expert parameters any rank holds).

    The fourth item is what ``zero_stage="auto"`` planned for: (micro_batch_size, seq_len), or ``None``.
    ``accumulate``: micro-batches per step (each rank's batch split so); a step's loss is the sum of theirs, which
    Lightning reports divided by ``accumulate``.
    """
    model = ZooLM(name)
    losses = GlobalLoss()
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy or "auto",
        max_steps=steps,
        callbacks=[losses],
        gradient_clip_val=gradient_clip_val,
        accumulate_grad_batches=accumulate,
    )
    data = tokens(steps)
    # Lightning gives a distributed run's training loader a shuffling DistributedSampler (seed 0); the
    # single process reads the same permutation, so both see the same global batches.
    sampler = None if strategy is not None else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH // dp // accumulate, sampler=sampler))
    if accumulate > 1:
        losses.losses = [sum(losses.losses[i : i + accumulate]) for i in range(0, len(losses.losses), accumulate)]
    if strategy is None:
        return losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, [], None, {}
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, held_shares(model))
    state = _local_state(model)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    merged, differing = {}, set()
    for rank_state in states:
        for key, value in rank_state.items():
            if key in merged and not torch.equal(merged[key], value):
                differing.add(key)
            merged.setdefault(key, value)
    planned = strategy.decision
    # A pipeline stage may hold no experts (a dense first stage): the most any rank holds of what some rank holds.
    most = {k: max(s.get(k, 0.0) for s in shares) for k in set().union(*shares)}
    return losses.losses, merged, sorted(differing), planned and planned.rows[0].activations, most


def train_zoo(layouts: list[str], models: list[str], every_rank: bool = False, steps: int = STEPS) -> dict | None:
    """Train every model under each layout (all of one world size) on this rank, one process group for all, for
    ``steps`` optimizer steps.

    Rank 0 (with ``every_rank``, each rank) returns {layout: {model: result, or the error text}}; a model's failure
    is its cell's result.
    """
    from lightning_llm.strategies import LLMParallelStrategy

    results = {}
    for layout in layouts:
        world_size, kwargs = LAYOUTS[layout]
        model_parallel = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
        dp = world_size // model_parallel // kwargs.get("context_parallel_size", 1)  # CP ranks read the same batch
        results[layout] = {}
        for name in models:
            try:
                strategy, accumulate = LLMParallelStrategy(**kwargs), ACCUMULATE.get(layout, 1)
                results[layout][name] = train(
                    name, strategy, devices=world_size, dp=dp, steps=steps, accumulate=accumulate
                )
            except Exception as error:
                results[layout][name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"
    return results if every_rank or dist.get_rank() == 0 else None

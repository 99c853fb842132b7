"""The plan entries sequence parallelism adds: residual-stream norms, embeddings and head, whole-sequence parts.

Under sequence parallelism the activations between blocks are sequence-sharded, so a plan that is complete for
plain tensor parallelism still misses modules that see those shards: the norms of the residual stream (split by
sequence), the embeddings and output head a plan may leave out (they open and close the sharded stream), and block
parts that need the whole sequence (an MoE block routes whole tokens; a part whose split layers all hand back whole
outputs computes on the whole sequence), which get ``gather_sequence``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from lightning_llm.modeling.blocks import block_names
from lightning_llm.parallel.tp.infer import output_head
from lightning_llm.parallel.tp.style_kinds import back_to_shards, coverer, matches, owns_subtree
from lightning_llm.parallel.tp.style_kinds import whole as is_whole


def add_sequence_parallel_norms(
    model: nn.Module, plan: dict[str, str], blocks_name: str = "", call_order: Sequence[str] = ()
) -> dict[str, str]:
    """Mark the normalisation layers of the residual stream ``sequence_parallel`` (they see sequence-sharded activations).

    A norm beside a planned layer inside a block's submodule (OLMo2's and litgpt's ``q_norm``/``k_norm``
    next to ``q_proj`` in the attention module) runs on whole-sequence activations, so it is left to the
    plan; the block's own norms (beside its ``mlp`` or even beside its own projections) are sharded, and so is a norm
    called before every planned layer beside it (a pre-norm: PaLM's ``norm`` beside its fused projection), as the
    traced forward's ``call_order`` shows, or as an ``nn.Sequential``'s order does.
    """
    plan = dict(plan)
    planned = [n for n, _ in model.named_modules() if n and any(matches(n, p) for p in plan)]
    order = {name: index for index, name in enumerate(call_order)}
    # Parts kept whole, and modules given the whole sequence outside the blocks: their norms are theirs.
    whole = coverer(
        {
            p: s
            for p, s in plan.items()
            if owns_subtree(s) or (s == "gather_sequence" and not p.startswith(f"{blocks_name}."))
        }
    )
    # Parents of planned layers inside a block, the block itself excepted (its own norms see the residual stream).
    in_block = re.compile(re.escape(blocks_name) + r"\.\d+\..+")
    beside_projection = {n.rpartition(".")[0] for n in planned if in_block.fullmatch(n.rpartition(".")[0])}
    for name, module in model.named_modules():
        if getattr(module, "is_pipeline_placeholder", False):
            continue
        is_norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("Norm", "RMSNorm"))
        beside = name.rpartition(".")[0] in beside_projection and not _leads(model, name, planned, order)
        if is_norm and name not in planned and not beside and not whole(name):
            plan[name] = "sequence_parallel"
    return plan


def _leads(model: nn.Module, name: str, planned: list[str], order: dict[str, int]) -> bool:
    """Whether ``name`` comes before every planned sibling (a pre-norm: it sees the stream): called first in the traced
    ``order``, or placed first in an ``nn.Sequential``."""
    parent_name, _, leaf = name.rpartition(".")
    beside = [n for n in planned if n.startswith(parent_name + ".")]
    if name in order and beside and all(n in order for n in beside):
        return all(order[name] < order[n] for n in beside)
    parent = model.get_submodule(parent_name)
    if not isinstance(parent, nn.Sequential):
        return False
    order = [c for c, _ in parent.named_children()]
    siblings = [n[len(parent_name) + 1 :].split(".")[0] for n in planned if n.startswith(parent_name + ".")]
    return all(order.index(leaf) < order.index(s) for s in siblings)


def add_sequence_parallel_boundaries(model: nn.Module, plan: dict[str, str], blocks_name: str) -> dict[str, str]:
    """Under sequence parallelism, the embeddings and output head the plan leaves out, split as :func:`.infer.infer_plan` would.

    SP needs the first block's input to be a sequence-sharded DTensor and the output head to gather
    it back; a plan without the embedding (HF GPT-NeoX) would hand the blocks a full-sequence plain
    tensor that SP reads as a local shard.
    """
    plan = dict(plan)
    prefix = blocks_name + "."

    def covered(name: str) -> bool:
        return any(matches(name, p) for p in plan)

    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and not name.startswith(prefix) and not covered(name):
            plan[name] = "embedding"
    head = output_head(model, prefix)
    if head is not None and not covered(head):
        plan[head] = "colwise_gather"
    # An MoE block routes whole tokens: it takes the gathered sequence and hands back its own shard. Named
    # one by one: in a hybrid stack the same name (``feed_forward``) can be a dense MLP in other blocks.
    plan |= dict.fromkeys(_outer_computations(model, plan, prefix), "gather_sequence")
    plan |= dict.fromkeys(_position_tables(model, plan, prefix), "positions")
    experts = [p for p, s in plan.items() if s in ("experts", "expert_parallel")]
    for name, _ in model.named_modules():
        parent = name.rpartition(".")[0]
        if parent and any(matches(name, p) for p in experts) and not covered(parent):
            plan[parent] = "gather_sequence"
    return _gather_parts_without_row_split(model, plan, blocks_name)


def _outer_computations(model: nn.Module, plan: dict[str, str], prefix: str) -> list[str]:
    """The outermost modules outside the blocks that hold a linear layer and that no plan entry names, contain
    neither an entry, the blocks nor an embedding (ModernBERT's prediction head between the final norm and the
    vocabulary projection, OPT's ``project_in``): under sequence parallelism each gets the whole sequence
    (``gather_sequence``), where its plain weights would otherwise meet the sharded stream."""
    named = [n for n, _ in model.named_modules() if n and any(matches(n, p) for p in plan)]
    embeddings = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    kept = [*named, *embeddings, prefix.rstrip(".")]
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not name or name.startswith(prefix) or any(name == c or name.startswith(c + ".") for c in chosen):
            continue
        if any(k == name or k.startswith(name + ".") for k in kept):
            continue
        if any(isinstance(m, nn.Linear) for m in module.modules()):
            chosen.append(name)
    return chosen


def _position_tables(model: nn.Module, plan: dict[str, str], prefix: str) -> list[str]:
    """The parameter-free modules outside the blocks that no entry names and that hold a 2-D table as wide as the
    token embeddings (XGLM's sinusoidal positions): what they return is added to the stream whole. A rotary
    module's table is a head's width, and what it returns goes into the blocks' attention, not the stream."""
    widths = {m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)}
    return [
        name
        for name, module in model.named_modules()
        if name
        and not name.startswith(prefix)
        and not any(True for _ in module.parameters())
        and not any(matches(name, p) for p in plan)
        and any(b.dim() == 2 and b.is_floating_point() and b.shape[-1] in widths for b in module.buffers(recurse=False))
    ]


def _gather_parts_without_row_split(model: nn.Module, plan: dict[str, str], blocks_name: str) -> dict[str, str]:
    """A block part whose split layers all hand back whole outputs (HF's gathered plans: Qwen3-Next's linear
    attention is ``colwise_gather`` only) computes on the whole sequence: it gets ``gather_sequence``."""
    blocks = model.get_submodule(blocks_name)
    for block_name in block_names(blocks_name, blocks):
        for part, _ in model.get_submodule(block_name).named_children():
            name = f"{block_name}.{part}"
            # Styles of the layers inside the part; a part that is itself one planned layer (a q_proj beside the
            # block's o_proj, the attention computed in the block's own forward) is not a part of its own.
            inside = [
                s
                for n, _ in model.get_submodule(name).named_modules()
                if n
                for p, s in plan.items()
                if matches(f"{name}.{n}", p)
            ]
            split = [s for s in inside if s == "gather_sequence" or not is_whole(s)]
            planned_itself = any(matches(name, p) for p in plan)  # never replace an entry the plan already has
            if (
                split
                and not planned_itself
                and "gather_sequence" not in split
                and not any(back_to_shards(s) for s in split)
            ):
                plan[name] = "gather_sequence"
    return plan

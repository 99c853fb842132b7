"""Which modules expert parallelism splits, the refusals for those it cannot, and its data parallelism.

MoE layers are found by structure, not by model name: an experts module keeps an int ``num_experts`` and holds its
expert weights itself, stacked with experts first and at least one 3-D (Hugging Face transformers 5's
``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3NaiveMoe``, ``GptOssExperts``, ...; see
:func:`lightning_llm.parallel.tp.experts.expert_count`). Routers (2-D weights), shared experts and dense MLPs are
not experts and stay data parallel. ``expert_parallel_plan`` (fnmatch pattern -> ``"expert_parallel"`` or
``"data_parallel"``) names a user's own module or keeps a found one whole; what cannot be split exactly is refused
before training, naming the module and the way out.

Data parallelism of the experts (applied before the blocks' FSDP2 units, which then leave the experts' parameters
to them): ZeRO 0 replicates them over ``edp``, ZeRO 1-3 shard them there with FSDP2. Each EP rank's expert gradient
already sums the contributions of its ``ep`` peers' tokens (the all-to-all's backward), so the style scales it by
``1 / ep`` and FSDP2's mean over ``edp`` completes the mean over all ``dp = ep * edp`` ranks: the mean over the
global batch, as for every other parameter. (FSDP2's own ``set_gradient_divide_factor(dp)`` would do it on NCCL, but
needs ``PREMUL_SUM``, which gloo lacks, and divides twice on a one-rank or replicate mesh in torch 2.13.)
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_llm._compat.torch_distributed import apply_parallel_style, replicate_with_fsdp
from lightning_llm.modeling.experts import expert_count, is_expert_list, named_like_experts
from lightning_llm.parallel.ep.expert_list import split_expert_list
from lightning_llm.parallel.ep.mesh import ExpertMeshes
from lightning_llm.parallel.ep.style import ExpertParallel, routed_arguments

log = logging.getLogger(__name__)

PLAN_STYLES = ("expert_parallel", "data_parallel")


def check_plan(plan: dict[str, str] | None) -> None:
    """Refuse a malformed ``expert_parallel_plan`` (at construction, before any process starts)."""
    if plan is None:
        return
    if not isinstance(plan, dict) or not all(isinstance(k, str) for k in plan):
        raise ValueError(
            f"expert_parallel_plan={plan!r} must map module-name patterns to styles, "
            "e.g. {'*.mlp.experts': 'expert_parallel'}."
        )
    bad = {k: v for k, v in plan.items() if v not in PLAN_STYLES}
    if bad:
        raise ValueError(f"expert_parallel_plan entries {bad} use an unknown style; use one of {PLAN_STYLES}.")


def check_experts(name: str, module: nn.Module, ep: int) -> None:
    """Refuse, before training, an experts module expert parallelism cannot split exactly.

    Example::

        check_experts("model.layers.0.mlp.experts", experts, ep=2)
    """
    keep = f"expert_parallel_plan={{'{name}': 'data_parallel'}}"
    if is_expert_list(module):
        if len(module) % ep:
            raise ValueError(
                f"{name!r} holds {len(module)} experts, not divisible by expert_parallel_size={ep}: each EP rank "
                f"holds whole experts. Use an expert_parallel_size that divides {len(module)}, or keep it whole: {keep}."
            )
        return
    count = expert_count(module)
    if count is None:
        raise ValueError(
            f"{name!r} cannot be split by expert: expert parallelism needs a module with an int `num_experts` whose "
            "parameters are all its own (none in submodules), stacked with `num_experts` as their first dimension and "
            f"at least one 3-D (Hugging Face's stacked experts). Keep it whole: {keep}."
        )
    if count % ep:
        raise ValueError(
            f"{name!r} has {count} experts, not divisible by expert_parallel_size={ep}: each EP rank holds whole "
            f"experts. Use an expert_parallel_size that divides {count}."
        )
    if routed_arguments(module) is None:
        raise ValueError(
            f"{name!r}'s forward does not take (tokens, top-k expert ids, top-k scores) as its first three arguments, "
            f"as Hugging Face's experts do (forward(hidden_states, top_k_index, top_k_weights)). Keep it whole: {keep}."
        )


def find_experts(module: nn.Module, plan: dict[str, str] | None = None) -> list[tuple[str, nn.Module]]:
    """The experts modules to split: found by structure, plus those the plan names; minus those it keeps whole."""
    plan = plan or {}
    found = []
    for name, child in module.named_modules():
        styles = [style for pattern, style in plan.items() if fnmatch(name, pattern)]
        if styles and len(set(styles)) > 1:
            raise ValueError(f"expert_parallel_plan gives {name!r} conflicting styles {sorted(set(styles))}.")
        style = styles[0] if styles else ("expert_parallel" if _looks_like_experts(child, name) else None)
        if style == "expert_parallel":
            found.append((name, child))
    return found


def _looks_like_experts(module: nn.Module, name: str = "") -> bool:
    """Stacked experts (by structure), or a ``ModuleList`` of identical modules named like experts."""
    if is_expert_list(module):
        return named_like_experts(name)
    return expert_count(module) is not None and routed_arguments(module) is not None


def check_expert_parallel_model(module: nn.Module, ep: int, plan: dict[str, str] | None = None) -> list[str]:
    """The names of the experts modules to split, found on the whole model (before a pipeline split leaves a stage
    with none: a dense first stage is fine). Refuses a model where nothing is found (expert parallelism would
    silently do nothing) and any experts module that cannot be split exactly, before anything is changed.

    Example::

        names = check_expert_parallel_model(lightning_module, ep=2)
    """
    targets = find_experts(module, plan)
    if not targets:
        raise ValueError(
            f"expert_parallel_size={ep} but the model has no experts module to split: none with an int `num_experts` "
            "and stacked (experts-first, 3-D) weights, taking forward(tokens, top_k_ids, top_k_scores), and no "
            "ModuleList of identical expert modules named like '*experts'. Name yours with expert_parallel_plan={'<module pattern>': 'expert_parallel'}, or use "
            "expert_parallel_size=1."
        )
    for name, experts in targets:
        check_experts(name, experts, ep)
    return [name for name, _ in targets]


def apply_expert_parallel(module: nn.Module, names: list[str], *, meshes: ExpertMeshes) -> list[nn.Module]:
    """Split the experts modules ``names`` (from :func:`check_expert_parallel_model`) that this rank holds over
    ``meshes.ep``, in place; returns the modules to make data parallel over ``meshes.edp``: the stacked experts
    modules, and the experts this rank keeps of each ``ModuleList`` (:mod:`.expert_list`); none on a pipeline stage
    without MoE layers.

    Example::

        names = check_expert_parallel_model(lightning_module, ep=2)
        experts = apply_expert_parallel(lightning_module, names, meshes=build_expert_meshes(dims, ep=2))
    """
    ep, held = meshes.ep.size(), dict(module.named_modules())
    targets = [(names.index(name), name, held[name]) for name in names if name in held]
    split = []
    for uid, name, experts in targets:
        if is_expert_list(experts):
            parent = module.get_submodule(name.rpartition(".")[0])
            split += split_expert_list(name, experts, parent, meshes.ep, uid)
        else:
            split.append(apply_parallel_style(ExpertParallel(grad_scale=1.0 / ep), experts, meshes.ep))
    log.info("Applied expert parallel (ep=%d, edp=%d) to %d experts modules", ep, meshes.edp.size(), len(targets))
    return split


def apply_expert_data_parallel(
    experts: list[nn.Module],
    *,
    meshes: ExpertMeshes,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
) -> None:
    """Make each experts module data parallel over ``meshes.edp`` as ZeRO ``zero_stage`` (gradients averaged there).

    Called before the blocks' own units, which then leave these parameters alone.
    """
    kwargs = dict(
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for module in experts:
        if zero_stage == 0:
            replicate_with_fsdp(module, mesh=meshes.edp, **kwargs)
        else:
            # Resharding a one-rank unit (ep == dp) frees nothing, so it is skipped.
            reshard = zero_stage == 3 and meshes.edp.size() > 1
            fully_shard(module, mesh=meshes.edp, reshard_after_forward=reshard, **kwargs)
        if getattr(module, "ep_owner_group", None) is not None:  # one expert of a ModuleList, held by this rank only
            for param in module.parameters():
                param.ep_owner_group = module.ep_owner_group
            # FSDP's implicit backward prefetch would unshard the unit before it in forward order from here: the
            # block before, at a point between this rank's own experts' all-to-alls, which other EP ranks (holding
            # other experts) reach elsewhere, and the collectives would cross. Prefetching itself (already
            # unsharded: a no-op) replaces the implicit choice.
            module.set_modules_to_backward_prefetch([module])

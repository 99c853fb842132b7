"""LLMParallelStrategy's options, each declared once: default, checked type, documentation and check.

Every argument of the strategy is one :func:`~.declarations.option` field below, in a frozen, keyword-only group
by concept (:class:`ParallelOptions`, :class:`PipelineOptions`, :class:`PlanningOptions`,
:class:`CheckpointingOptions`, and the process group's settings). :func:`build_options` runs each
option's check, then the checks that span several (:mod:`.option_combinations`), and returns frozen
:class:`StrategyOptions`. The strategy's ``Arguments:`` docstring section and its read-only option attributes are
rendered from the same table (:func:`~.declarations.with_declared_options`). What changes during a run (the ZeRO
stage "auto" resolves to, the mesh, ...) lives in :class:`~lightning_llm.strategies.run_state.RunState` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.modeling.blocks import BlocksOverride
from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import ACCUMULATION_SYNC, FSDP2_ZERO_STAGES
from lightning_llm.parallel.pipeline.stage_plan import PipelineSpec
from lightning_llm.planning.device_rates import KNOWN_DEVICES
from lightning_llm.strategies import option_checks as checks
from lightning_llm.strategies.declarations import build, check_each, option
from lightning_llm.strategies.option_combinations import check_combinations
from lightning_llm.validation import check_bool, check_timeout

# The collective timeout for training (see LLMParallelStrategy's `timeout` argument).
TRAINING_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """The layout and how each block is parallelized."""

    tensor_parallel_size: int | Literal["auto"] = option(
        1,
        'ranks that split each layer\'s matrices (innermost mesh axis); ``"auto"``: every device of a node, as in '
        "Lightning's ``ModelParallelStrategy``.",
        check=checks.int_or_auto("or 'auto' for every device of a node"),
    )
    pipeline_parallel_size: int = option(
        1,
        "ranks that each run a contiguous stage of the blocks (the outermost mesh axis); 1 turns pipeline "
        "parallelism off. See ``pipeline_schedule`` and the docs' pipeline page.",
        check=checks.positive_int("1 turns pipeline parallelism off"),
    )
    data_parallel_size: int | Literal["auto"] = option(
        "auto",
        'model replicas reading different data; ``"auto"`` = world size / (tp * pp * cp).',
        check=checks.int_or_auto("or 'auto' for world size / (tp * pp)"),
    )
    data_parallel_replicate_size: int = option(
        1,
        "with ZeRO 2/3, groups that replicate rather than shard (HSDP); sharding then spans "
        "``data_parallel_size / data_parallel_replicate_size`` ranks.",
        check=checks.positive_int(),
    )
    zero_stage: Literal[0, 1, 2, 3, "auto"] = option(  # as asked; RunState holds the stage "auto" resolves to
        3,
        '0 (replicated), 1 and 2 (optimizer state and gradients sharded), 3 (everything sharded), or "auto": the '
        "least-communication stage (then CPU offload) that the memory planner finds fits.",
        check=checks.one_of(*FSDP2_ZERO_STAGES, "auto"),
    )
    sequence_parallel: bool = option(
        False, "shard activations between blocks along the sequence (needs tp > 1).", check=check_bool
    )
    tensor_parallel_plan: dict[str, str] | None = option(
        None,
        "module-name patterns (fnmatch, as in ``named_modules()`` of the LightningModule) to styles: "
        '"colwise", "rowwise", "colwise_gather", "embedding", "sequence_parallel", "replicate", ... (see the docs\' '
        "tensor-parallel page). Merged per module with the module's ``tensor_parallel_plan()``, the model's Hugging "
        "Face ``_tp_plan`` and inference, in that order of precedence; a part of a block left whole on every rank "
        "is refused at setup.",
        check=checks.tensor_parallel_plan,
    )
    tensor_parallel_replicate: list[str] = option(
        None,
        'module-name patterns kept whole on every rank on purpose (e.g. ``["*.router"]``), exempt from that refusal '
        "and shown as replicated in the coverage report.",
        check=checks.patterns("['*.router']"),
    )
    blocks: BlocksOverride = option(
        None,
        "dotted name of the ``nn.ModuleList`` or ``nn.Sequential`` of transformer blocks, if discovery (the "
        "container of layers holding most parameters, classes mixed or not) picks the wrong one; or the blocks' "
        "dotted names as a list, or a callable ``(name, module) -> bool`` choosing them, for blocks that share no "
        "container (ZeRO 0-3, activation checkpointing and compile only). A model with no container at all is "
        "sharded by its top-level units (see ``lightning_llm.modeling.blocks.default_units``).",
        check=checks.blocks_override,
    )
    cpu_offload: bool = option(  # as asked; RunState holds the choice of "auto"
        False,
        "keep sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy).",
        check=check_bool,
    )
    compile_blocks: bool = option(False, "``torch.compile`` each block.", check=check_bool)
    fp8: str | None = option(  # the recipe's name, or None when off
        False,
        "train the blocks' Linear layers in fp8 with torchao's float8 (``pip install 'lightning_llm[fp8]'``): "
        '``True``/"tensorwise" or "rowwise" scaling. Use it with ``precision="bf16-mixed"``: everything but those '
        "matmuls stays in bf16. The output head, layers with dims not divisible by 16 and ``fp8_exclude`` patterns "
        "are skipped. With tensor parallelism (tensorwise only) the column- and row-split layers use torchao's "
        "float8 TP styles; other Linear layers of the blocks stay high precision. Needs compute capability >= 8.9 "
        "on CUDA (H100, L40S, ...).",
        check=checks.fp8_recipe,
    )
    fp8_exclude: list[str] = option(
        None,
        "module-name patterns (fnmatch, as in ``named_modules()``) kept out of fp8.",
        check=checks.patterns("['*.down_proj']"),
    )
    expert_parallel_size: int = option(
        1,
        "ranks, carved out of the data-parallel ones, over which the experts of every MoE layer are split (whole "
        "experts per rank; tokens move to them by all-to-all). It must divide the number of experts and the "
        "data-parallel size; under ZeRO 1-3 the experts are also sharded over the data-parallel ranks outside their "
        "group. See the docs' expert-parallel page.",
        check=checks.positive_int("1 turns expert parallelism off"),
    )
    expert_parallel_plan: dict[str, str] | None = option(
        None,
        'module-name pattern (fnmatch) -> ``"expert_parallel"`` (split a user\'s own experts module) or '
        '``"data_parallel"`` (keep a found one whole); experts modules are otherwise found by shape.',
        check=checks.expert_parallel_plan,
    )
    context_parallel_size: int = option(
        1,
        "ranks that split every sequence (the ``cp`` mesh axis): each holds two head-tail (zig-zag) chunks of every "
        "sample from the embedding to the output, attention gathers the other ranks' keys/values, and the logits are "
        "gathered back, so the user's loss is computed unchanged and exactly. The CP ranks read the same batch; FSDP "
        "shards over data-parallel × CP ranks. The sequence length must be a multiple of "
        "``2 * context_parallel_size``.",
        check=checks.positive_int("1 turns context parallelism off"),
    )
    context_parallel_method: Literal["ring", "ulysses"] = option(
        "ring",
        '"ring" (ring attention: key/value shards passed around the CP group, partial outputs merged by '
        'log-sum-exp) or "ulysses" (all-to-all to whole heads over the whole sequence and back; the query heads '
        "must divide by ``context_parallel_size * tensor_parallel_size``).",
        check=checks.context_parallel_method,
    )
    accumulation_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = option(
        "auto",
        "with ``accumulate_grad_batches > 1``, how the micro-batches before the last one of a step reduce their "
        'gradients: "every_micro_batch" (reduce-scatter each, so gradients stay sharded: ZeRO 1-3 keep their memory '
        'promise), "last_micro_batch" (no reduction until the last, like DDP\'s ``no_sync``: fewer collectives, but '
        'every rank holds the whole unsharded gradients meanwhile) or "auto" (the first at ZeRO 1-3, the second at '
        "ZeRO 0). Within one pipeline-parallel step torch's schedule reduces at the last of its micro-batches "
        "either way.",
        check=checks.one_of(*ACCUMULATION_SYNC),
    )


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The pipeline schedule; ``num_microbatches`` left ``None`` is chosen at setup from the per-rank batch size."""

    schedule: str = option(
        "1F1B",
        'with pipeline parallelism, torch\'s schedule: "GPipe", "1F1B", "Interleaved1F1B", '
        '"InterleavedZeroBubble", "ZBVZeroBubble" or "LoopedBFS" (the interleaved and looped ones run several '
        "stages per rank, see ``virtual_stages``).",
        check=checks.pipeline_schedule,
        argument="pipeline_schedule",
    )
    num_microbatches: int | None = option(
        None,
        "with pipeline parallelism, micro-batches each step's per-rank batch is cut into. Unset, one sample per "
        "micro-batch (torchtitan's default, the smallest bubble the batch allows) when the per-rank batch size is "
        "known and a multiple of ``pipeline_parallel_size``, else one per stage; a bubble above 25% of the step is "
        "warned about at setup, naming the count that would bring it under.",
        check=checks.positive_int(optional=True),
    )
    virtual_stages: int | None = option(
        None,
        "stages per pipeline rank for the interleaved and looped schedules (default: 2 for them, 1 for GPipe and "
        "1F1B, which take only 1); ``pipeline_parallel_size * virtual_stages`` may not exceed the blocks.",
        check=checks.positive_int(optional=True),
    )
    split: list[list[str]] | None = option(
        None,
        'the blocks of each stage by name, instead of the split that balances modelled FLOPs: ``[["model.layers.'
        '[0-3]"], ["model.layers.[4-7]"]]`` (module-name patterns, one list per stage, in order).',
        check=checks.pipeline_split,
        argument="pipeline_split",
    )

    def spec(self) -> PipelineSpec:
        """A fresh :class:`PipelineSpec` for one run (setup fills its ``seq_len``)."""
        return PipelineSpec(self.schedule, self.num_microbatches, self.virtual_stages, self.split)


@dataclass(frozen=True, kw_only=True)
class PlanningOptions:
    """The layout "auto" chooses, activation checkpointing and the inputs of "auto" planning (layout, ZeRO stage,
    checkpointed blocks)."""

    layout: Literal["auto"] | None = option(
        None,
        '``"auto"``: the tensor, pipeline and context parallel sizes, sequence parallelism, ZeRO stage, activation '
        "checkpointing and pipeline micro-batches chosen at setup, once for the job, as the layout of the fewest "
        "predicted seconds per trained sequence whose planned memory fits (``device_memory``); each data-parallel "
        "rank keeps the dataloader's batch. Logged with the runner-up. Leave what it chooses at its defaults. "
        "``expert_parallel_size`` is kept as given. See ``docs/plan.md``.",
        check=checks.one_of(None, "auto"),
    )
    layout_rates: str = option(
        "auto",
        'with ``layout="auto"``: the rates step times are predicted from: ``"calibrate"`` (measured at setup on this '
        "machine: a matmul, memory, per-op costs and the all-reduce between the ranks), a device's table entry "
        '(``"H100"``, ``"H200"``, ``"A100"``), or ``"auto"``: the table\'s entry for a known GPU, else measured.',
        check=checks.one_of("auto", "calibrate", *KNOWN_DEVICES),
    )

    activation_checkpointing: Literal["none", "full", "selective", "auto"] = option(
        "none",
        '"none"; "full" (every block keeps only its input); "selective" (by op: matmul and attention outputs kept, '
        'the rest recomputed; or every n-th block fully, see ``activation_checkpointing_options``); or "auto": '
        "the fewest, heaviest blocks checkpointed so the blocks' activations, measured on fake tensors before "
        'training, fit ``activation_checkpointing_options["budget"]``.',
        check=checks.activation_checkpointing_mode,
    )
    ac_options: ACOptions = option(
        None,
        "the mode's knobs (a dict, or :class:`~lightning_llm.parallel.activation_checkpointing.ACOptions`): "
        '``selective`` ("op" or "layer"), ``every_n_layers``, ``recompute_every_other_matmul`` for "selective"; '
        '``budget`` (bytes, or a fraction of device memory in (0, 1]) and ``device_memory`` for "auto".',
        check=checks.activation_checkpointing_options,
        argument="activation_checkpointing_options",
    )
    device_memory: int | str | None = option(
        None,
        'bytes (or "80GB") per device for "auto" planning; default: what the device reports.',
        check=checks.memory_size,
    )
    micro_batch_size: int | None = option(
        None,
        'samples per micro-batch for "auto" planning (default: the datamodule\'s ``batch_size``, else the first '
        "training batch).",
        check=checks.positive_int(optional=True),
    )
    seq_len: int | None = option(
        None,
        'tokens per sample for "auto" planning (default: the datamodule\'s ``seq_len``, else the first batch) and '
        "for balancing pipeline stages by modelled FLOPs (default: the datamodule's ``seq_len``, else none).",
        check=checks.positive_int(optional=True),
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointingOptions:
    """Sharded (DCP) or full checkpoints, and a Hugging Face checkpoint to start from."""

    save_distributed_checkpoint: bool = option(
        True, "save one shard per rank (``True``) or a full checkpoint on rank 0.", check=check_bool
    )
    load_pretrained: str | None = option(
        None,
        "a local Hugging Face checkpoint directory (safetensors, single or sharded with its index) loaded into the "
        "sharded model before training; its tensor names must match the module's parameter names after a common "
        "prefix (e.g. a LightningModule holding ``self.model = LlamaForCausalLM``).",
        check=checks.optional_str("a Hugging Face checkpoint directory or a checkpoint file"),
    )


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """Every argument of an ``LLMParallelStrategy``, checked (groups by concept, then the process group's)."""

    parallel: ParallelOptions
    pipeline: PipelineOptions
    planning: PlanningOptions
    checkpointing: CheckpointingOptions
    process_group_backend: str | None = option(
        None,
        '"nccl", "gloo", ...; the default follows the device.',
        check=checks.optional_str("a torch.distributed backend, e.g. 'nccl'"),
    )
    timeout: timedelta = option(
        TRAINING_TIMEOUT,
        "how long a collective may wait for the other ranks (a ``timedelta`` or seconds; NCCL and gloo), 10 minutes "
        "by default rather than torch's 30: long enough for a checkpoint save or the first step's compilation, short "
        "enough that a rank that stopped responding does not hold the job for half an hour. Add "
        ":class:`~lightning_llm.callbacks.RankWatchdog` to learn which rank it was.",
        check=check_timeout,
    )
    fault_tolerance: bool | Literal["ddp", "local_sgd", "diloco"] = option(
        False,
        "train as one of several torchft replica groups (its own launch, with ``TORCHFT_LIGHTHOUSE``, "
        "``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` set; :mod:`~lightning_llm.strategies.replica_groups`, "
        '``docs/fault-tolerance.md``). ``True`` or ``"ddp"``: gradients are averaged over the groups present at every '
        "step, a group lost mid-step is dropped and the others go on, a group that starts late or restarts recovers "
        'the weights, optimizer state and step from a live peer. ``"local_sgd"`` (parameters averaged) and '
        '``"diloco"`` (an outer Nesterov SGD step on the averaged pseudo-gradients) synchronize the groups every '
        "``fault_tolerance_sync_every`` steps only, for slow links between groups. Needs ``pip install torchft``.",
        check=checks.one_of(False, True, "ddp", "local_sgd", "diloco"),
    )
    fault_tolerance_sync_every: int = option(
        100,
        'with ``fault_tolerance="local_sgd"`` or ``"diloco"``: the optimizer steps between two synchronizations of '
        "the replica groups.",
        check=checks.positive_int(),
    )


def build_options(**arguments) -> StrategyOptions:
    """LLMParallelStrategy's keyword arguments (the same names, every one), checked: each option alone, then together.

    Example::

        from lightning_llm.strategies.declarations import declarations

        defaults = {d.argument: d.default for d in declarations(StrategyOptions)}
        options = build_options(**{**defaults, "zero_stage": 2})
    """
    options = build(StrategyOptions, check_each(StrategyOptions, arguments))
    check_combinations(options, given_ac_options=arguments["activation_checkpointing_options"])
    if options.planning.layout is None and options.planning.layout_rates != "auto":
        rank_zero_warn(f"layout_rates={options.planning.layout_rates!r} ignored: it applies to layout='auto'.")
    return options

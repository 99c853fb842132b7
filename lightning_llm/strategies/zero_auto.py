"""``zero_stage="auto"`` for both strategies: measure the model, plan every option, log the choice.

The planner itself (:mod:`lightning_llm.planning.zero`) is arithmetic; this module feeds it what it
needs from a run (device memory, the micro-batch shape, the model's measured footprint) and reports
the decision through the run's loggers.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils.data import IterableDataset

from lightning_llm._compat.lightning import fit_loop_data_source
from lightning_llm._compat.torch import tree_leaves
from lightning_llm.modeling.activations import measure_model_activations, parameter_counts
from lightning_llm.modeling.optimizer_state import optimizer_states
from lightning_llm.parallel.activation_checkpointing import ACOptions, block_policies, saves_output
from lightning_llm.parallel.devices import min_over_ranks, total_device_memory
from lightning_llm.parallel.ep.apply import find_experts
from lightning_llm.parallel.tp.model_plan import planned_shares
from lightning_llm.planning.activation_budget import predicted_peak
from lightning_llm.planning.device_memory import device_memory_bytes
from lightning_llm.planning.memory import ModelFootprint
from lightning_llm.planning.zero import GiB, ZeroDecision, plan_zero_stage


def model_footprint(
    module: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str = "32-true",
    ac_options: ACOptions | None = None,
    expert_parallel_plan: dict[str, str] | None = None,
    cp: int = 1,
    context_parallel_method: str = "ring",
    tp: int = 1,
    sequence_parallel: bool = False,
    tensor_parallel_plan: dict[str, str] | None = None,
    tensor_parallel_replicate: list[str] | tuple[str, ...] = (),
    documents: bool = False,
) -> ModelFootprint:
    """Parameter counts and activation bytes of ``module`` under each checkpointing mode, on fake tensors.

    Each mode's bytes are the peak of backward walking the blocks last to first
    (:func:`~lightning_llm.planning.activation_budget.predicted_peak`): every block keeps what its policy keeps
    (all it saves; its input; its input and the outputs of the ops the selective policy saves) while the block
    running backward holds all it saves; what is saved outside the blocks (embedding output, the head's input,
    the logits the loss keeps) is added to every mode. "selective" follows ``ac_options`` (per operator, or every
    ``every_n_layers``-th block in full); recomputing every other matmul is planned as keeping them (an upper bound).
    The optimizer state is that of ``module.configure_optimizers()``, measured on fake tensors
    (:mod:`lightning_llm.modeling.optimizer_state`); the MoE experts are found as expert parallelism finds them
    (``expert_parallel_plan`` as the strategy's), so their parameters can be divided by ``ep``.

    Context parallelism (``cp``, ``context_parallel_method``) and tensor parallelism (``tp``, ``sequence_parallel``, the plan's entries) are
    planned per rank: see ``_activations_per_mode`` and ``_tp_shares``. ``documents``: the run's batches carry packed
    documents' ids, so its attention calls are masked (under CP each rank then gathers the keys and values whole).

    Example::

        with torch.device("meta"):
            module = CausalLM("7B"); module.configure_model()
        model_footprint(module, micro_batch_size=1, seq_len=4096, precision="bf16-mixed")
    """
    num_params, largest, outside = parameter_counts(module)
    shares = _tp_shares(module, tp, sequence_parallel, tensor_parallel_plan, tensor_parallel_replicate)
    sizes = measure_model_activations(
        module,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        saves_output=saves_output,
        shares=shares,
        documents=documents,
    )
    none, full, selective = _activations_per_mode(
        sizes, cp, micro_batch_size, ac_options or ACOptions(), context_parallel_method
    )
    return ModelFootprint(
        num_params,
        largest,
        outside,
        none,
        full,
        selective,
        optimizer_states(module).states,
        sum(p.numel() for _, experts in find_experts(module, expert_parallel_plan) for p in experts.parameters()),
        activations_tp=tp,
    )


def _tp_shares(module: nn.Module, tp: int, sequence_parallel: bool, plan, replicate):
    """One tensor-parallel rank's share of each tensor under the model's plan (``None`` without tp).

    With ``tp > 1`` the activations are one tensor-parallel rank's, read from the model's dataflow under its plan
    (the strategy's ``tensor_parallel_plan``/``tensor_parallel_replicate`` as given, the rest as parallelize finds
    it): a head-sharded region's tensors count ``1/tp``, the residual stream whole (``1/tp`` with
    ``sequence_parallel``), and each column split's input whole, once per split under sequence parallelism, where
    each gathers its own copy (:mod:`lightning_llm.modeling.tp_shares`). A plan tensor parallelism refuses is refused
    here, with parallelize()'s message.
    """
    if tp == 1:
        return None
    return planned_shares(module, tp=tp, sequence_parallel=sequence_parallel, user_plan=plan, replicate=replicate)


def _activations_per_mode(
    sizes, cp: int, micro_batch_size: int, options: ACOptions, method: str = "ring"
) -> tuple[int, int, int]:
    """Peak activation bytes without checkpointing, with full and with selective checkpointing (see
    :func:`model_footprint`).

    The planner divides activations by the context-parallel size ``cp``; sequence mixers other than attention
    (Mamba, gated delta-net, short convolutions), and blocks that run no attention at all, run on whole sequences
    under CP, split by batch rows when the micro-batch divides by ``cp`` (:mod:`lightning_llm.parallel.cp.gathered`),
    else whole on one rank, successive blocks' on successive ranks (:mod:`lightning_llm.parallel.cp.owner`): their
    owner counts them ``cp`` times (so that the division leaves them whole), the others not at all, and the plan is
    the largest rank's. An attention call with a mask keeps the keys and values whole
    and a mask per query chunk (:meth:`~lightning_llm.modeling.attention_saves.AttentionSaves.per_rank`): counted
    the same way, as ``cp`` times a rank's bytes, in every mode's block running backward and without checkpointing.
    Under the ring (``method``), the buffers its backward allocates for one call (``ring_buffers``) are added to the
    peak, once: one block's backward runs at a time. Ulysses' all-to-all buffers were not seen in the measured peak.
    """
    inputs = [s.input for s in sizes]
    policies = block_policies("selective", range(len(sizes)), options.selective, options.every_n_layers)
    around = sizes.outside  # the embedding's output, the head's input and the logits the loss keeps, in every mode
    if method == "ring":
        around += cp * max((call.ring_buffers(cp) for s in sizes for call in s.attention), default=0)
    peaks = [0, 0, 0]
    for owned in _mixer_owners(sizes, cp, micro_batch_size):
        saved = [s.saved + _gathered(s.gathered, cp, own) + _masked_attention(s, cp) for s, own in zip(sizes, owned)]
        op = [
            s.saved if s.op is None else s.op + _gathered(s.op if not s.attends else s.mixers, cp, own)
            for s, own in zip(sizes, owned)
        ]
        kept = {"none": saved, "full": inputs, "op": op}
        selective = [kept[policy][i] for i, policy in enumerate(policies)]
        for mode, held in enumerate((saved, inputs, selective)):
            peaks[mode] = max(peaks[mode], around + predicted_peak(saved, held))
    return tuple(peaks)


def _mixer_owners(sizes, cp: int, micro_batch_size: int) -> list[list[bool | None]]:
    """Per CP rank, per block: whether the rank runs the block's gathered part whole (its owner), ``None`` where
    it is split by batch rows (or there is none). Successive blocks with such a part have successive owners."""
    if cp == 1 or micro_batch_size % cp == 0:
        return [[None] * len(sizes)]
    ranks, k = [[None] * len(sizes) for _ in range(cp)], 0
    for i, block in enumerate(sizes):
        if block.gathered:
            for r in range(cp):
                ranks[r][i] = r == k % cp
            k += 1
    return ranks


def _gathered(nbytes: int, cp: int, owner: bool | None) -> int:
    """What a gathered part adds to a block's bytes before the division by ``cp``: its owner holds it whole (``cp``
    times its share), the others nothing of it."""
    return 0 if owner is None else (cp - 1) * nbytes if owner else -nbytes


def _masked_attention(sizes, cp: int) -> int:
    """What a block's attention calls save under ``cp`` beyond ``1/cp`` of one process's, times ``cp``."""
    return sum(cp * call.per_rank(cp) - call.total for call in sizes.attention) if cp > 1 else 0


def choose_zero_stage(
    model: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str = "32-true",
    ac_options: ACOptions | None = None,
    expert_parallel_plan: dict[str, str] | None = None,
    sequence_parallel: bool = False,
    tensor_parallel_plan: dict[str, str] | None = None,
    tensor_parallel_replicate: list[str] | tuple[str, ...] = (),
    context_parallel_method: str = "ring",
    documents: bool = False,
    **options: Any,
) -> ZeroDecision:
    """Measure ``model`` (meta device is fine) and plan: :func:`~lightning_llm.planning.zero.plan_zero_stage`'s options.

    Example::

        choose_zero_stage(module, device_memory=80 * 2**30, world_size=64, tp=8, micro_batch_size=1, seq_len=4096)
    """
    footprint = model_footprint(
        model,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        ac_options=ac_options,
        expert_parallel_plan=expert_parallel_plan,
        cp=options.get("cp", 1),
        context_parallel_method=context_parallel_method,
        documents=documents,
        tp=options.get("tp", 1),
        sequence_parallel=sequence_parallel,
        tensor_parallel_plan=tensor_parallel_plan,
        tensor_parallel_replicate=tensor_parallel_replicate or (),
    )
    return plan_zero_stage(footprint, precision=precision, **options)


def planning_inputs(
    trainer: L.Trainer,
    device: torch.device,
    device_memory: int | str | None,
    micro_batch_size: int | None,
    seq_len: int | None,
) -> dict[str, int]:
    """Device memory, micro-batch shape and packed documents for planning inside a strategy: given, or read off the run.

    The shape comes from, in order: the strategy's arguments, the datamodule's ``batch_size``/``seq_len``
    hyperparameters, and the first training batch (its first tensor of two or more dims, read as
    (batch, sequence)): a plain DataLoader passed to ``fit`` or a datamodule without those hparams. The device
    memory is the smallest over all ranks (when a process group is initialized), so the job decides once.
    ``documents``: the datamodule's ``return_document_ids`` (its batches then mask attention by document).
    """
    hparams = trainer.datamodule.hparams if trainer.datamodule is not None else {}
    micro_batch_size = micro_batch_size or hparams.get("batch_size")
    seq_len = seq_len or hparams.get("seq_len")
    if not micro_batch_size or not seq_len:
        batch_size, batch_seq_len = first_batch_shape(trainer, device)
        micro_batch_size, seq_len = micro_batch_size or batch_size, seq_len or batch_seq_len
    memory = device_memory_bytes(device_memory) if device_memory is not None else total_device_memory(device)
    memory = min_over_ranks(memory)  # every rank plans from the same memory, so all choose the same stage
    documents = bool(hparams.get("return_document_ids", False))
    return {"device_memory": memory, "micro_batch_size": micro_batch_size, "seq_len": seq_len, "documents": documents}


def first_batch_shape(trainer: L.Trainer, device: torch.device) -> tuple[int, int]:
    try:
        batch = example_batch(trainer, device)
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f"Automatic ZeRO selection needs the micro-batch shape and could not read a training batch ({error}). "
            "Pass micro_batch_size and seq_len to the strategy."
        ) from error
    tokens = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if tokens is None:
        raise ValueError(
            "Automatic ZeRO selection reads the micro-batch shape from the first training batch, but it holds no "
            "tensor of shape (batch, sequence, ...). Pass micro_batch_size and seq_len to the strategy."
        )
    return tokens.shape[0], tokens.shape[1]


def decide_and_report(trainer: L.Trainer, module: nn.Module, *, name: str, **planning: Any) -> ZeroDecision:
    """Plan with :func:`choose_zero_stage`, log the table on rank 0 and put the decision in the loggers' hyperparameters."""
    decision = choose_zero_stage(module, precision=str(trainer.precision), **planning)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    memory = f"{planning.get('device_memory', 0) / GiB:.1f} GiB, the smallest device memory over {ranks} ranks"
    rank_zero_info(
        f"{name}: zero_stage='auto' chose ZeRO {decision.stage}, offload {decision.offload!r} ({memory}):\n"
        f"{decision.table}"
    )
    for logger in trainer.loggers:
        logger.log_hyperparams({"zero_stage": decision.stage, "zero_offload": decision.offload})
        if isinstance(logger, WandbLogger) and decision.rows:  # the whole plan, as a table in the run
            columns = [
                "zero_stage",
                "offload",
                "params_gib",
                "grads_gib",
                "optimizer_gib",
                "activations_gib",
                "total_gib",
                "fits",
                "chosen",
            ]
            data = [
                [
                    row.zero_stage,
                    row.offload,
                    row.params / GiB,
                    row.grads / GiB,
                    row.optimizer / GiB,
                    row.activations / GiB,
                    row.total / GiB,
                    row.fits,
                    (row.zero_stage, row.offload) == (decision.stage, decision.offload),
                ]
                for row in decision.rows
            ]
            logger.log_table("plan/zero_stage", columns=columns, data=data)
    return decision


def example_batch(trainer: L.Trainer, device: torch.device) -> Any:
    """One real-shaped training batch, read from the dataset without touching the sampler's position."""
    loader = trainer.datamodule.train_dataloader() if trainer.datamodule is not None else None
    if loader is None:
        # Dataloaders passed straight to fit(): Lightning keeps them in the fit loop's data source (private).
        loader = fit_loop_data_source(trainer).dataloader()
    dataset, size = loader.dataset, loader.batch_size
    if size is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            "activation_checkpointing='auto' measures one batch from a map-style dataset with a batch_size; "
            "this DataLoader has neither. Choose 'full' or 'selective' instead."
        )
    return move_data_to_device(loader.collate_fn([dataset[i] for i in range(size)]), device)

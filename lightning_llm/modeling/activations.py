"""Per-block activation memory: the bytes each transformer block keeps for backward.

Two ways to measure the same three numbers per block (:class:`BlockActivations`):

* :func:`measure_blocks` runs one real forward of the model (``measure_fn()``, e.g. a training
  step's loss computation). Saved tensors are counted and then dropped at once, so the pass holds
  at most one block's activations: cheap on CPU and safe on a GPU that could not hold them all.
  It works on blocks already split by tensor parallelism (local shards are counted).
* :func:`measure_block_activations` runs the forward under ``FakeTensorMode`` with the
  parameters swapped for fake copies: nothing is allocated, and a model on the meta device works.

How the bytes are counted is :mod:`lightning_llm.modeling.activation_tally`; fake tensors come from
:mod:`lightning_llm.modeling.fake`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import astuple, replace

import torch
from torch import nn

from lightning_llm._compat.torch import FAKE_TENSOR_LOGGER
from lightning_llm.modeling.activation_tally import (
    BlockActivations,
    BlockTally,
    MeasuredBlocks,
    counting,
    storage_of,
)
from lightning_llm.modeling.attention_saves import AttentionSaves
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.fake import fake_parameters
from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.modeling.repeated_blocks import measure_repeated
from lightning_llm.modeling.tp_shares import TensorParallelShares


def measure_blocks(
    blocks: Sequence[nn.Module],
    measure_fn: Callable[[], object],
    saves_output: Callable | None = None,
    shares: TensorParallelShares | None = None,
) -> MeasuredBlocks:
    """Measure each block during one real call of ``measure_fn()`` (a forward of the model holding ``blocks``).

    The pass keeps no activations beyond the block that is running; its result is discarded and
    it cannot be differentiated. ``saves_output(op) -> bool`` is the selective policy's choice of
    ops to save; without it ``op`` is not measured.

    Example::

        sizes = measure_blocks(model.layers, lambda: model(tokens).sum())
    """
    params = [p for block in blocks for p in block.parameters()]
    tally = BlockTally(len(blocks), params, keep=False, shares=shares)
    with counting(blocks, tally, saves_output):
        measure_fn()
    missed = [i for i, ran in enumerate(tally.ran) if not ran]
    if missed:
        raise RuntimeError(
            f"measure_fn() ran no forward through blocks {missed}; it must run one forward of the model holding "
            "these blocks (e.g. lambda: module.training_step(batch, 0))."
        )
    return tally.result(saves_output is not None)


def measure_block_activations(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    step: Callable[[], object],
    saves_output=None,
    device=None,
    shares: TensorParallelShares | None = None,
) -> MeasuredBlocks:
    """Run ``step()`` (one forward of ``module`` on a real-shaped batch) on fake tensors and measure each block.

    ``step`` is called inside the fake mode; tensors it creates from real data are converted on
    the fly. ``device``: the batch's, where a meta-device module is faked (:func:`.fake.fake_parameters`). Example::

        sizes = measure_block_activations(module, list(blocks), lambda: module.training_step(batch, 0))
    """
    # Parameters are told apart by storage: the fakes, recognised inside the call (where they are the module's).
    tally = BlockTally(len(blocks), [], keep=True, shares=shares)

    def run() -> None:
        tally.params = {storage_of(p) for p in module.parameters()}
        with counting(blocks, tally, saves_output):
            step()

    fake_parameters(module, run, device=device)
    return tally.result(saves_output is not None)


def activation_bytes(
    module: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str = "none",
    batch_fn=None,
    precision: str = "32-true",
) -> float:
    """Bytes autograd keeps for one micro-batch, measured on fake tensors.

    "full" keeps each block's input plus, while one block recomputes, that block's activations; the
    other modes are planned at their "none" value (an upper bound; the strategies' planner,
    :func:`lightning_llm.strategies.zero_auto.model_footprint`, plans "selective" by its policy). ``batch_fn(b, t)`` builds a batch;
    by default (b, t + 1) token ids, the layout of :class:`~lightning_llm.models.CausalLM`. The forward
    runs in the parameters' dtype; for 16-bit precisions the bytes are halved (autocast keeps nearly
    every saved activation in 16 bits).
    """
    return activation_bytes_by_mode(
        module, micro_batch_size=micro_batch_size, seq_len=seq_len, batch_fn=batch_fn, precision=precision
    )[activation_checkpointing == "full"]


def activation_bytes_by_mode(
    module: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    batch_fn=None,
    precision: str = "32-true",
) -> tuple[float, float]:
    """(without checkpointing, with full checkpointing) bytes of :func:`activation_bytes`, from one fake forward.

    A model of more than two identical blocks is measured on its first two
    (:mod:`lightning_llm.modeling.repeated_blocks`), the rest taken as equal to the second.

    Example::

        none, full = activation_bytes_by_mode(module, micro_batch_size=1, seq_len=4096, precision="bf16-mixed")
    """
    sizes = measure_model_activations(
        module, micro_batch_size=micro_batch_size, seq_len=seq_len, batch_fn=batch_fn, precision=precision
    )
    return sum(s.saved for s in sizes), sum(s.input for s in sizes) + max(s.saved for s in sizes)


def measure_model_activations(
    module: nn.Module,
    *,
    micro_batch_size: int,
    seq_len: int,
    batch_fn=None,
    precision: str = "32-true",
    saves_output: Callable | None = None,
    shares: TensorParallelShares | None = None,
    documents: bool = False,
) -> MeasuredBlocks:
    """Per-block bytes of one micro-batch (:class:`BlockActivations`), and those outside the blocks, from one fake
    forward of ``module``.

    ``saves_output(op)``: the selective policy's choice of ops to keep, to measure ``op`` too. ``shares``: count one
    tensor-parallel rank's share of each tensor (:mod:`.tp_shares`) instead of all of it. ``documents``: the batch
    carries packed documents' ids (``{"input_ids", "document_ids"}``, as ``LLMDataModule(return_document_ids=True)``
    gives them), so the model's attention runs with a document mask, as in the run. For 16-bit
    precisions the bytes are halved (the forward runs in the parameters' dtype; autocast keeps nearly every
    saved activation in 16 bits). Example::

        sizes = measure_model_activations(module, micro_batch_size=1, seq_len=4096, saves_output=saves_output)
    """
    device = planning_device(module)
    batch = (
        batch_fn(micro_batch_size, seq_len)
        if batch_fn
        else torch.zeros(micro_batch_size, seq_len + 1, dtype=torch.long, device=device)
    )
    if documents and batch_fn:
        raise ValueError("measure_model_activations: give documents=True or a batch_fn, not both (batch_fn's batch "
                         "is used as it is; put the document ids in it).")  # fmt: skip
    if documents:
        batch = {"input_ids": batch, "document_ids": torch.zeros_like(batch)}
    name, blocks = find_blocks(module)
    step = lambda: module.training_step(batch, 0)  # noqa: E731
    outside = []

    def measure(sample: list) -> MeasuredBlocks:
        sizes = measure_activations(module, sample, step, device=device, saves_output=saves_output, shares=shares)
        outside.append(sizes.outside)
        return sizes

    with redirected_log(module):
        # Identical blocks: two measured stand for all (modeling.repeated_blocks), so planning a deep model costs
        # the same as a shallow one.
        sizes = measure_repeated(module, name, blocks, measure) or measure(list(blocks))
    half = precision.startswith(("bf16", "16")) and next(module.parameters()).element_size() == 4
    result = MeasuredBlocks(_halved(s) if half else s for s in sizes)
    result.outside = outside[-1] // 2 if half else outside[-1]
    return result


def _halved(sizes: BlockActivations) -> BlockActivations:
    """A block's bytes in 16 bits, from a forward run in 32."""
    attention = tuple(AttentionSaves(*(n // 2 for n in astuple(call))) for call in sizes.attention)
    op = None if sizes.op is None else sizes.op // 2
    return replace(sizes, saved=sizes.saved // 2, input=sizes.input // 2, op=op, mixers=sizes.mixers // 2,
                   attention=attention)  # fmt: skip


def planning_device(module: nn.Module) -> torch.device:
    """Where a model's forward is faked to measure it: its parameters' device, or the CPU for a meta-device model.

    On the meta device ``scaled_dot_product_attention`` takes its math path, which keeps the whole attention matrix
    (heads x s^2 per layer) for backward; no kernel a run uses keeps it (flash, memory-efficient and cuDNN attention on
    GPUs, the flash kernel on CPUs: each keeps q, k, v, the output and the log-sum-exp). Fake CPU tensors dispatch to
    the CPU flash kernel, so what a meta model saves is counted as a run saves it, still without allocating.
    """
    device = next(module.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def measure_activations(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    step: Callable[[], object],
    device: torch.device | None = None,
    saves_output: Callable | None = None,
    shares: TensorParallelShares | None = None,
) -> MeasuredBlocks:
    """:func:`measure_block_activations` (fake tensors), or one real forward where a kernel has no fake version.

    Some kernels lack a fake implementation for some dtypes (torch's grouped_mm, which Hugging Face MoE experts
    use, demands bf16 on fake tensors). A model with real weights is then measured by :func:`measure_blocks`,
    which holds at most one block's activations at a time; on the meta device the error stands. ``device``: the
    batch's (see :func:`measure_block_activations`). Example::

        sizes = measure_activations(module, list(module.model.layers), lambda: module.training_step(batch, 0))
    """
    on_meta = any(p.is_meta for p in module.parameters())
    with _quiet_fake_kernel_errors(not on_meta):
        try:
            return measure_block_activations(
                module, blocks, step, saves_output=saves_output, device=device, shares=shares
            )
        except RuntimeError:
            if on_meta:
                raise
    return measure_blocks(blocks, step, saves_output, shares)


@contextmanager
def _quiet_fake_kernel_errors(quiet: bool):
    """Silence torch's log of a failed fake kernel while a real-forward fallback is there to take over."""
    fake_log = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = fake_log.level
    if quiet:
        fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


def parameter_counts(module: nn.Module) -> tuple[int, int, int]:
    """(all parameters, the largest block's, those outside the blocks) of ``module`` (meta device is fine)."""
    _, blocks = find_blocks(module)
    total = sum(p.numel() for p in module.parameters())
    in_blocks = sum(p.numel() for p in blocks.parameters())
    return total, max(sum(p.numel() for p in b.parameters()) for b in blocks.children()), total - in_blocks

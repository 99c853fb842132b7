"""Our tensor-parallel style names as ``torch.distributed.tensor.parallel`` styles.

Every style is torch's own ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel`` with the
input/output layouts the position in the model needs, except :class:`ReplicateGradSum`, a small
``ParallelStyle`` (built with torch's ``distribute_module``) for a module kept whole on every rank
but applied to each rank's own heads, the fused-projection and ``Conv1D`` styles of :mod:`.fused`,
and the expert split of :mod:`.experts`. A torchao ``Float8Linear`` gets the fp8 styles of :mod:`.float8`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_llm._compat.torch_distributed import apply_parallel_style
from lightning_llm.parallel.tp.experts import ExpertsParallel, sum_grad
from lightning_llm.parallel.tp.float8 import float8_parallel_style
from lightning_llm.parallel.tp.fused import (
    FUSED_PREFIX,
    Conv1DColwise,
    Conv1DRowwise,
    FusedColwise,
    fused_sizes,
    is_conv1d,
    projection_dims,
    shared_parts,
)
from lightning_llm.parallel.tp.multihead_attention import MultiheadAttentionParallel
from lightning_llm.parallel.tp.style_kinds import SHARED_PREFIX as SHARED_PREFIX


class ReplicateGradSum(ParallelStyle):
    """Keep the module's parameters whole on every rank and sum their gradients over the tp group.

    For a module inside the head-sharded region of a block (between a column-split and a row-split
    layer), e.g. Qwen3's per-head ``q_norm``: each rank applies the same weight to its own heads, so
    each rank's weight gradient is the contribution of its heads only, and the true gradient is their
    **sum** (not the mean: the loss is one function of all heads; every head's term appears once).
    The parameters become ``Replicate`` DTensors and the module input the local rows of a ``Shard(0)``
    DTensor: to DTensor the local tensors are disjoint pieces of one computation, so the weight
    gradient comes out ``Partial`` and torch all-reduces (sums) it into the ``Replicate`` gradient.
    ``Shard(0)`` (rows) is a valid description for any per-row module (a norm over the last dim); it
    is torch's own bookkeeping, so FSDP2 on top sees ordinary (dp, tp) DTensor parameters.

    Example::

        parallelize_module(model, tp_mesh, {"layers.*.self_attn.q_norm": ReplicateGradSum()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._local_rows, output_fn=self._to_local)

    @staticmethod
    def _local_rows(module, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [Shard(0)], run_check=False) if _plain_tensor(x) else x for x in inputs
        )

    @staticmethod
    def _to_local(module, outputs, device_mesh):
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs


class ReplicateShared(ParallelStyle):
    """Keep a projection whole on every rank when some of its outputs feed every rank's heads directly.

    Multi-query attention's single key/value head (separate ``k_proj``/``v_proj``) and multi-head latent
    attention's down-projections are computed whole on every rank: each rank's heads read all of it.
    The last ``shared`` output columns are used by the heads directly, so each rank's gradient of them
    is its own heads' share and is summed over the tp group (Megatron's replicated k/v); the other
    columns feed a column-split layer, whose input gradient torch already sums. Then the weights'
    gradients and the input gradient are whole and identical on every rank, and the parameters stay
    plain tensors like any ``replicate`` module. Under sequence parallelism the sequence-sharded input
    is gathered first (its gradient is then whole on every rank, so the backward only slices it).

    Arguments:
        shared: how many trailing output columns feed the heads directly (``None``: all of them).
        sequence_parallel: whether a plain input is this rank's sequence shard (as for ``colwise``).

    Example::

        parallelize_module(model, tp_mesh, {"layers.*.attn.k_proj": ReplicateShared()})
    """

    def __init__(self, shared: int | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.shared, self.sequence_parallel = shared, sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda m, args: self._whole_input(args, device_mesh))
        module.register_forward_hook(lambda m, args, output: self._sum_shared_grad(output, device_mesh))
        return module

    def _whole_input(self, args: tuple, mesh: DeviceMesh) -> tuple:
        x, *rest = args
        if _plain_tensor(x) and self.sequence_parallel:
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()]).to_local()
        return (x, *rest)

    def _sum_shared_grad(self, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        shared = output.shape[-1] if self.shared is None else self.shared
        if shared == 0:
            return output
        if shared == output.shape[-1]:
            return sum_grad(output, mesh)
        kept, heads = output.split([output.shape[-1] - shared, shared], dim=-1)
        return torch.cat([kept, sum_grad(heads, mesh)], dim=-1)


class OwnIndexEmbedding(RowwiseParallel):
    """A vocabulary-split embedding whose subclass computes the indices it looks up: OPT's learned positions take
    the attention mask (and ``position_ids=``) and look up ``position_ids + 2``. Every tensor argument becomes a
    replicated DTensor, so the lookup inside the forward meets a DTensor index whatever the forward's signature;
    torch's style converts the first argument only, and passes on no other.

    Example::

        parallelize_module(model, tp_mesh, {"model.decoder.embed_positions": OwnIndexEmbedding()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_fn = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        distribute_module(module, device_mesh, self._partition_embedding_fn, None, output_fn)
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _replicated(args, kwargs, device_mesh), with_kwargs=True
        )
        return module


def _replicated(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    def replicate(x):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _plain_tensor(x) else x

    return tuple(map(replicate, args)), {key: replicate(value) for key, value in kwargs.items()}


class SequenceParallelNorm(ParallelStyle):
    """torch's ``SequenceParallel`` with the module's floating buffers replicated too (a norm keeping a fixed bias as
    a buffer, PaLM's ``beta``), so the norm's computation meets DTensors only; torch's style replicates parameters."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = SequenceParallel()
        style.src_data_rank = self.src_data_rank
        module = apply_parallel_style(style, module, device_mesh)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and not isinstance(buffer, DTensor):
                setattr(module, name, DTensor.from_local(buffer, device_mesh, [Replicate()], run_check=False))
        return module


class OwnLocalOutput(ParallelStyle):
    """``style`` whose DTensor output is handed to the model as a local tensor of its own, not a view.

    torch's ``to_local()`` returns a view made inside an autograd Function, which autograd forbids
    modifying in place; model code that adds into a row-wise layer's output (HF Falcon's
    ``mlp_output += attention_output``) would fail. One copy of the layer's output avoids it.
    """

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.style.src_data_rank = self.src_data_rank
        apply_parallel_style(self.style, module, device_mesh)
        module.register_forward_hook(lambda m, args, output: output.to_local().clone())
        return module


class GatherSequence(ParallelStyle):
    """Under sequence parallelism, run a module on whole sequences: its first input gathered, its output re-split.

    For a module that routes whole tokens (an MoE layer). The output (or the first element of a tuple
    output: GptOss's MLP also returns its router scores, left as they are) becomes this rank's sequence
    shard again, as a ``Shard(1)`` DTensor like the rest of the sequence-parallel residual stream.

    Example::

        parallelize_module(model, tp_mesh, {"layers.*.mlp": GatherSequence()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shapes: list[torch.Size] = []  # (batch, sequence) per call in flight (activation checkpointing re-enters)
        module.register_forward_pre_hook(
            lambda m, args, kwargs: self._gather(args, kwargs, device_mesh, shapes), with_kwargs=True
        )
        module.register_forward_hook(lambda m, args, output: self._split(output, device_mesh, shapes), always_call=True)
        return module

    @staticmethod
    def _gather(args: tuple, kwargs: dict, mesh: DeviceMesh, shapes: list) -> tuple[tuple, dict]:
        """The hidden state (the first positional argument, else ``hidden_states=``) as the whole sequence."""
        key = 0 if args else "hidden_states"
        x = args[0] if args else kwargs[key]
        if _plain_tensor(x):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        x = x.redistribute(mesh, [Replicate()]).to_local()
        shapes.append(x.shape[:2])  # to re-split a token-flattened output
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, key: x})

    @staticmethod
    def _split(output, mesh: DeviceMesh, shapes: list):
        """The output (or a tuple's first element) as this rank's sequence shard of a ``Shard(1)`` DTensor."""
        shape = shapes.pop() if shapes else None
        if shape is None or output is None:  # the pre-hook or the forward raised
            return output
        batch, length = shape
        first = output[0] if isinstance(output, tuple) else output
        if first.dim() == 2 and first.shape[0] == batch * length:  # tokens flattened (Llama 4's MoE): (b, s, d) back
            first = first.unflatten(0, (batch, length))
        first = DTensor.from_local(first, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (first, *output[1:]) if isinstance(output, tuple) else first


class ReplicatedOutput(ParallelStyle):
    """A module's tensor output as a replicated DTensor: the same whole value on every rank, so that adding it to
    the sequence-sharded stream (a ``Shard(1)`` DTensor under SP) takes each rank's positions of it. For a
    parameter-free position table outside the blocks (XGLM's sinusoidal positions), whose plain output would
    otherwise meet the DTensor stream.

    Example::

        parallelize_module(model, tp_mesh, {"model.embed_positions": ReplicatedOutput()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(m, args, output):
            if not _plain_tensor(output):
                return output
            return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)

        module.register_forward_hook(replicate)
        return module


def _plain_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def is_float8_linear(module: nn.Module | None) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (False when torchao is not installed)."""
    if module is None or type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def parallel_style(style: str, sequence_parallel: bool, module: nn.Module | None = None) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for one of our style names applied to ``module`` (``None``: leave it as it is).

    ``module`` matters for Hugging Face ``Conv1D`` layers (weights stored transposed), fused projections and
    fp8 layers.
    """
    sharded_seq = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    if is_float8_linear(module):
        fp8_style = float8_parallel_style(style, sequence_parallel, module)
        return OwnLocalOutput(fp8_style) if fp8_style is not None and style == "rowwise" and local else fp8_style
    conv1d = module is not None and is_conv1d(module)
    if style.startswith(FUSED_PREFIX):
        sizes = fused_sizes(style, projection_dims(module)[1])
        return FusedColwise(sizes, input_layouts=sharded_seq, shared=shared_parts(style))
    if style == "colwise_replicated_input":  # input whole on every rank even under SP (after a ReplicateShared layer)
        return ColwiseParallel(input_layouts=Replicate())
    if style == "replicate_shared" or style.startswith(SHARED_PREFIX):
        shared = int(style[len(SHARED_PREFIX) :]) if style.startswith(SHARED_PREFIX) else None
        return ReplicateShared(shared, sequence_parallel)
    if style == "colwise":
        return Conv1DColwise(input_layouts=sharded_seq) if conv1d else ColwiseParallel(input_layouts=sharded_seq)
    if style == "rowwise":
        if conv1d:
            return Conv1DRowwise(output_layouts=sharded_seq, use_local_output=local)
        if local:
            return OwnLocalOutput(RowwiseParallel(use_local_output=False))
        return RowwiseParallel(output_layouts=sharded_seq, use_local_output=False)
    if style == "colwise_gather":
        if conv1d:
            return Conv1DColwise(input_layouts=sharded_seq, output_layouts=Replicate())
        return ColwiseParallel(input_layouts=sharded_seq, output_layouts=Replicate())
    if style == "rowwise_split_input":  # input replicated (full width), each rank multiplies its columns
        if conv1d:
            return Conv1DRowwise(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
    if style == "embedding":
        if module is not None and type(module).forward is not nn.Embedding.forward:
            return OwnIndexEmbedding(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
    if style == "sequence_parallel":
        return SequenceParallelNorm() if sequence_parallel else None
    if style == "replicate_grad_sum":
        return ReplicateGradSum()
    if style == "experts":
        return ExpertsParallel()
    if style == "multihead_attention":
        return MultiheadAttentionParallel(
            parallel_style("rowwise", sequence_parallel, getattr(module, "out_proj", None))
        )
    if style == "positions":  # a parameter-free table the model adds to the sequence-sharded stream
        return ReplicatedOutput() if sequence_parallel else None
    if style == "gather_sequence":  # a module that needs the whole sequence inside a sequence-parallel model
        if not sequence_parallel:
            return None
        return GatherSequence()
    return None  # "replicate"; "expert_parallel": split by expert parallelism over its own mesh

"""PyTorch's own ``nn.MultiheadAttention`` split by heads under tensor parallelism.

``nn.MultiheadAttention`` keeps q, k and v in one ``in_proj_weight`` Parameter (``[q | k | v]`` rows) and computes
through ``F.multi_head_attention_forward``, which checks every width against the whole embedding: no hook can hand
it one rank's heads. :class:`MultiheadAttentionParallel` therefore shards ``in_proj_weight``/``in_proj_bias`` by rows
(``Shard(0)``, contiguous like any column split, so checkpoints and FSDP see ordinary shards), splits ``out_proj``
row-wise, and gives the module (by a class swap to :class:`SplitHeadsMultiheadAttention`, its state untouched) a
forward computing this rank's heads with the same operations: the in-projection on the local rows, an all-to-all
regrouping them into this rank's share of q, k and v (as ``fused_colwise`` does), ``scaled_dot_product_attention``
with the module's masks, and the row-split ``out_proj`` summing over ranks.

Self-attention (``query is key is value``), as ``nn.TransformerEncoderLayer`` and decoder-only models call it, is
split; other calls, biases on k/v and ``add_zero_attn`` are refused by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llm._compat.torch_distributed import apply_parallel_style
from lightning_llm.parallel.tp.fused import Regroup, regroup_exchange


def check_multihead_attention(name: str, module: nn.MultiheadAttention, tp: int) -> None:
    """Refuse, before anything changes, what :class:`MultiheadAttentionParallel` cannot split, naming the fix."""
    why = None
    if module.num_heads % tp:
        why = f"its num_heads={module.num_heads} is not divisible by tensor_parallel_size={tp}"
    elif module.in_proj_weight is None:
        why = "its key/value widths differ from the query's (kdim/vdim): q, k and v are separate weights"
    elif module.bias_k is not None or module.add_zero_attn:
        why = "it adds a bias to k/v (add_bias_kv) or a zero attention slot (add_zero_attn), one for all heads"
    if why:
        raise ValueError(
            f"Tensor parallelism cannot split {name} (nn.MultiheadAttention by heads): {why}. Keep it whole: "
            f"tensor_parallel_replicate=['{name}'], or use a tensor_parallel_size dividing the heads."
        )


class MultiheadAttentionParallel(ParallelStyle):
    """Split an ``nn.MultiheadAttention`` by heads (see the module docstring).

    Arguments:
        out_style: the row split of ``out_proj`` (its output whole, or reduce-scattered to sequence shards under
            sequence parallelism, as the plan's ``rowwise`` gives it).

    Example::

        parallelize_module(model, tp_mesh, {"encoder.layers.*.self_attn": MultiheadAttentionParallel(RowwiseParallel())})
    """

    def __init__(self, out_style: ParallelStyle) -> None:
        super().__init__()
        self.out_style = out_style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, embed = device_mesh.size(), module.embed_dim
        for name in ("in_proj_weight", "in_proj_bias"):
            param = getattr(module, name)
            if param is not None:
                shard = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        self.out_style.src_data_rank = self.src_data_rank
        apply_parallel_style(self.out_style, module.out_proj, device_mesh)
        send, input_splits, output_splits = regroup_exchange((embed,) * 3, tp, device_mesh.get_local_rank())
        module.__class__ = SplitHeadsMultiheadAttention
        module.split = _Split(Regroup(send, input_splits, output_splits, device_mesh), device_mesh, tp)
        module.num_heads //= tp
        return module


class _Split:
    """What a split module needs at call time: the regrouping of its in-projection, its mesh and the tp size."""

    def __init__(self, regroup: Regroup, mesh: DeviceMesh, tp: int) -> None:
        self.regroup, self.mesh, self.tp = regroup, mesh, tp


class SplitHeadsMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` computing this rank's heads (installed by :class:`MultiheadAttentionParallel`)."""

    split: _Split
    heads_divided = True  # num_heads is already this rank's: the plan's head-count division leaves it

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """The module's own arguments; the attention weights are not returned (no rank holds every head's)."""
        if not (query is key is value):
            raise RuntimeError(
                "Tensor parallelism splits this nn.MultiheadAttention for self-attention (query is key is value); it "
                "was called with other keys or values. Keep it whole: tensor_parallel_replicate=[its name]."
            )
        # The whole input on every rank; its gradient is each rank's heads' share, summed over the ranks (Megatron's
        # f); a sequence-parallel input is gathered first, its gradient reduce-scattered.
        x, mesh = query, self.split.mesh
        x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        if not self.batch_first:
            x = x.transpose(0, 1)
        batch, length, _ = x.shape
        weight, bias = (p.to_local() if isinstance(p, DTensor) else p for p in (self.in_proj_weight, self.in_proj_bias))
        q, k, v = self.split.regroup(self, (x,), F.linear(x, weight, bias)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        mask, causal = _mask(attn_mask, key_padding_mask, is_causal, need_weights, x.dtype, self, batch)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))
        return (out if self.batch_first else out.transpose(0, 1)), None


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: masked out) as the additive float mask ``F.multi_head_attention_forward`` makes of it."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _mask(attn_mask, key_padding_mask, is_causal: bool, need_weights: bool, dtype, module, batch: int):
    """(mask for this rank's heads, is_causal) as ``F.multi_head_attention_forward`` combines them."""
    padding = _additive(key_padding_mask, dtype)
    if is_causal and padding is None and not need_weights:
        return None, True  # the hint alone, as torch passes it to SDPA
    mask = _additive(attn_mask, dtype)
    if mask is not None and mask.dim() == 3:  # one mask per (batch, head): this rank's heads
        heads, rank = module.num_heads, module.split.mesh.get_local_rank()
        mask = mask.view(batch, -1, *mask.shape[1:])[:, rank * heads : (rank + 1) * heads]
    if padding is not None:
        padding = padding.view(batch, 1, 1, -1)
        mask = padding if mask is None else mask + padding
    return mask, False

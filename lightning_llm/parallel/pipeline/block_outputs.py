"""What a pipeline stage takes from a block's output, and what stands in for the blocks it does not run.

Blocks return the hidden state as a bare tensor (Llama, GPT-2), as the first element of a tuple
(``(hidden, attn_weights)``: Falcon, MPT, GPT-Neo, Bloom) or as the first field of a dataclass such as a
``ModelOutput``. Only the hidden state crosses a stage boundary, as in torchtitan and Megatron: the
other elements (attention weights, per-block caches) belong to blocks of one stage and are needed by no
other. Blocks a stage does not run return the structure the user's loop indexes (``layer(...)[0]``,
``.hidden_states``), with their hidden-state input in the hidden state's place and ``None`` elsewhere,
which is what a Hugging Face block returns for attention weights it was not asked for.

The structure is learned from the block outputs this rank sees. A stage whose first call is to a
block it does not run (every stage but the first, on its first micro-batch) learns it once by running its
own first block as it is about to run it (the same arguments, the received activation in), without
gradient, with the random state restored and with any KV cache copied, so that the real call sees exactly
what it would have seen.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_llm.parallel.kv_cache import CACHE_ARGUMENTS, CACHE_OBJECT_ARGUMENTS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OutputForm:
    """How a block's output holds its hidden state: ``kind`` is "tensor", "sequence" (tuple, list) or "dataclass"."""

    kind: str
    cls: type
    names: tuple[str, ...] = ()  # a dataclass's fields, the hidden state's first

    @classmethod
    def of(cls, output: Any, block_name: str) -> OutputForm:
        """The form of ``output``; a ``TypeError`` naming the block when no hidden-state tensor comes first."""
        if isinstance(output, torch.Tensor):
            form = cls("tensor", type(output))
        elif isinstance(output, (tuple, list)) and output:
            form = cls("sequence", type(output), tuple(str(i) for i in range(len(output))))
        elif dataclasses.is_dataclass(output) and not isinstance(output, type):
            form = cls("dataclass", type(output), tuple(f.name for f in dataclasses.fields(output) if f.init))
        else:
            form = None
        if form is None or not isinstance(form.hidden(output), torch.Tensor):
            raise TypeError(
                f"Pipeline parallelism passes the hidden state between stages and finds it as a block's output "
                f"tensor, the first element of its tuple or the first field of its dataclass, but {block_name} "
                f"returned {type(output).__name__} with no tensor there. Return the hidden state first, or train "
                "without pipeline parallelism."
            )
        return form

    def hidden(self, output: Any) -> torch.Tensor:
        """The hidden state inside ``output``."""
        if self.kind == "tensor":
            return output
        return output[0] if self.kind == "sequence" else getattr(output, self.names[0], None)

    def around(self, hidden: torch.Tensor) -> Any:
        """An output of this form holding ``hidden`` and ``None`` in every other place."""
        if self.kind == "tensor":
            return hidden
        values = [hidden] + [None] * (len(self.names) - 1)
        if self.kind == "dataclass":
            return self.cls(**dict(zip(self.names, values)))
        return self.cls(*values) if hasattr(self.cls, "_fields") else self.cls(values)  # a namedtuple, or not

    def dropped(self, output: Any) -> list[str]:
        """The places other than the hidden state's that hold something in ``output``."""
        if self.kind == "tensor":
            return []
        values = output if self.kind == "sequence" else [getattr(output, n, None) for n in self.names]
        return [name for name, value in zip(self.names[1:], list(values)[1:]) if value is not None]


class BlockOutputs:
    """The output form of one block list, learned from its outputs and shared by its gated calls."""

    def __init__(self) -> None:
        self.form: OutputForm | None = None
        self._noted: set[str] = set()

    def hidden(self, block: nn.Module, output: Any, block_name: str) -> torch.Tensor:
        """The hidden state in a block's ``output``; an output of a new type sets the form (noted once a class)."""
        if self.form is None or type(output) is not self.form.cls:
            self.form = OutputForm.of(output, block_name)
            self._note(block, output)
        return self.form.hidden(output)

    def passed_through(self, hidden: torch.Tensor, learn: Callable[[], tuple[nn.Module, Any]]) -> Any:
        """What a block this stage does not run returns: ``hidden`` in the form, from ``learn()``'s output if need be."""
        if self.form is None:
            block, output = learn()
            self.hidden(block, output, type(block).__name__)
        return self.form.around(hidden)

    def _note(self, block: nn.Module, output: Any) -> None:
        dropped = self.form.dropped(output)
        if not dropped or type(block).__name__ in self._noted:
            return
        self._noted.add(type(block).__name__)
        if self.form.kind == "sequence":
            first, others = "first element, the hidden state", f"element {', '.join(dropped)}"
        else:
            first, others = f"first field, {self.form.names[0]}", ", ".join(dropped)
        log.warning(
            f"Pipeline parallelism: {type(block).__name__} returns a {self.form.cls.__name__}; only its {first}, "
            f"crosses pipeline stage boundaries. The rest ({others}) stays on its stage: calls of blocks on "
            "other stages give None in its place."
        )


def _is_cache(value: Any) -> bool:
    return value is not None and hasattr(value, "get_seq_length")  # Hugging Face's Cache interface


def probe(block: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``block``'s output on these arguments, leaving no trace: no gradient, random state restored, caches copied.

    A KV cache may come by keyword or by position (GPT-2's blocks take ``past_key_values`` second): the probe's
    keys and values, appended to the real cache, would make the real call attend over them too (same output,
    half its key/value gradient lost).
    """
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    cache_names = (*CACHE_ARGUMENTS, *CACHE_OBJECT_ARGUMENTS)
    args = tuple(copy.deepcopy(a) if _is_cache(a) else a for a in args)
    kwargs = {
        k: copy.deepcopy(v) if (k in cache_names and v is not None) or _is_cache(v) else v for k, v in kwargs.items()
    }
    devices = [] if device.type == "cpu" else [device]
    with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=device.type):
        return block(*args, **kwargs)

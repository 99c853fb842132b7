"""Trained weights out: a Lightning checkpoint of any layout -> a Hugging Face directory ``from_pretrained`` loads.

The checkpoint is read whole in one process (:func:`lightning_llm.checkpointing.consolidate.read_model_state`: a DCP
directory saved under ZeRO-3, tensor or pipeline parallelism, or a ``.ckpt`` file). Its tensors go
into the Hugging Face model class, built on the meta device from the config the checkpoint names
(:mod:`lightning_llm.hf.export_info`), and ``save_pretrained`` writes ``config.json``,
``generation_config.json`` and ``model.safetensors`` (sharded with an index above ``max_shard_size``).
The reference :class:`~lightning_llm.models.llama.Llama` becomes a ``LlamaForCausalLM`` through
:mod:`lightning_llm.hf.llama_map`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_llm.checkpointing.consolidate import cast_floats, parse_dtype, read_model_state
from lightning_llm.checkpointing.errors import write_named
from lightning_llm.hf import llama_map
from lightning_llm.hf.export_info import ModelSource, resolve_source
from lightning_llm.hf.load import match_names
from lightning_llm.modeling.tied import tied_parameter_names
from lightning_llm.models.llama import Llama


def _own_tensors(state: dict[str, torch.Tensor], prefix: str | None, names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of the model at ``prefix`` (found by matching ``names`` if ``None``), prefix removed."""
    if prefix is None:
        prefix, mapping = match_names(list(state), set(names))
        return {mapping[k]: v for k, v in state.items() if k in mapping}
    own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not own:
        raise ValueError(
            f"The checkpoint holds no tensor under the model's prefix {prefix!r} (e.g. {sorted(state)[:3]})."
        )
    return own


def _hf_state(state: dict[str, torch.Tensor], source: ModelSource):
    """(Hugging Face state dict, Hugging Face config, model class) for the checkpoint's model."""
    if source.kind == "reference_llama":
        with torch.device("meta"):
            names = list(Llama(source.config).state_dict())
        own = _own_tensors(state, source.prefix, names)
        hf_state = {llama_map.to_hf_name(k): llama_map.to_hf_tensor(k, v, source.config) for k, v in own.items()}
        import transformers

        return hf_state, llama_map.to_hf_config(source.config), transformers.LlamaForCausalLM
    with torch.device("meta"):
        names = list(source.model_class(source.config).state_dict())
    return _own_tensors(state, source.prefix, names), source.config, source.model_class


def _fill(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Assign ``state`` to ``model`` (built on meta), strict both ways; tied weights stay one tensor.

    A tied group needs one of its names in ``state``; if it has several, they must be equal.
    """
    expected = set(model.state_dict())
    tied = tied_parameter_names(model)
    optional = set()
    for group in tied:
        present = [n for n in group if n in state]
        optional.update(n for n in group if n != (present or group)[0])
        for other in present[1:]:
            if not torch.equal(state[present[0]], state[other]):
                diff = (state[present[0]].float() - state[other].float()).abs().max().item()
                raise ValueError(
                    f"The model ties {present[0]} and {other}, but the checkpoint holds different values for them "
                    f"(max difference {diff:.3g}); was it trained with tied weights? Export with a config that unties them."
                )
    missing = sorted(expected - set(state) - optional)
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint's tensors do not fit {type(model).__name__}: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}. Export with the config of the model that was trained (--hf_config DIR)."
        )
    model.load_state_dict({k: v for k, v in state.items() if k not in optional}, strict=False, assign=True)
    for group in tied:  # assign replaced the shared Parameter on one name only: point the others at it again
        keep = next(n for n in group if n in state)
        owner, _, attr = keep.rpartition(".")
        for other in group:
            if other != keep:
                module_name, _, other_attr = other.rpartition(".")
                setattr(model.get_submodule(module_name), other_attr, getattr(model.get_submodule(owner), attr))


def export_hf(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    hf_config: str | Path | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write a Hugging Face directory from a Lightning checkpoint; ``AutoModelForCausalLM.from_pretrained`` loads it.

    Arguments:
        checkpoint: a sharded checkpoint directory saved by LLMParallelStrategy (any tp/pp/ZeRO layout) or a
            single ``.ckpt`` file.
        output_dir: created if needed; receives ``config.json``, ``generation_config.json`` and
            ``model.safetensors`` (or shards + ``model.safetensors.index.json``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; default: the checkpoint's own dtype.
        hf_config: a Hugging Face directory (or its ``config.json``) describing the model, for checkpoints that
            do not say (saved by another strategy); LLMParallelStrategy's checkpoints and ``CausalLM`` need none.
        max_shard_size: largest safetensors file before the weights are split, as ``save_pretrained`` takes it.

    Example::

        export_hf("checkpoints/step=1000.ckpt", "export/llama-hf", dtype="bfloat16")
        model = transformers.AutoModelForCausalLM.from_pretrained("export/llama-hf")
    """
    dtype = parse_dtype(dtype)
    state, rest = read_model_state(checkpoint)
    source = resolve_source(rest, hf_config, checkpoint)
    hf_state, config, model_class = _hf_state(state, source)
    hf_state = cast_floats(hf_state, dtype)
    floats = {v.dtype for v in hf_state.values() if v.is_floating_point()}
    config.dtype = dtype or (floats.pop() if len(floats) == 1 else torch.float32)
    with torch.device("meta"):
        model = model_class(config)
    _fill(model, {k: v.contiguous() for k, v in hf_state.items()})
    output_dir = Path(output_dir)
    from safetensors import SafetensorError  # what save_pretrained's safetensors writer raises on a failed write

    save = lambda: model.save_pretrained(output_dir, max_shard_size=max_shard_size)  # noqa: E731
    write_named(output_dir, save, errors=(OSError, RuntimeError, SafetensorError))
    return output_dir

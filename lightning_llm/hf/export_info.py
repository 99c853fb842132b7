"""What a Hugging Face export needs besides the tensors: which model, its config, where it sits in the module.

LLMParallelStrategy stores it in every checkpoint it saves (``checkpoint["hf_export"]``, from
:func:`describe_model`), so ``lightning-llm export CKPT OUT --format hf`` needs nothing else. For a
checkpoint saved by another strategy the export falls back to the reference model's
hyperparameters (``CausalLM(config=...)``), or to a Hugging Face config the user names
(``--hf_config DIR``: the directory the model was loaded from, or its ``config.json``).

A checkpoint is a user's file: the class its entry names is looked up among ``transformers``' top-level
``PreTrainedModel`` subclasses (:func:`allowed_model_class`), never imported by its module path, so an entry cannot
make the export import (and run) a module of its choosing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_llm._compat.transformers import is_pretrained_model
from lightning_llm.hf.llama_map import reference_config
from lightning_llm.models.llama import Llama, LlamaConfig

EXPORT_KEY = "hf_export"


@dataclass
class ModelSource:
    """The model a checkpoint's tensors belong to.

    Arguments:
        kind: ``"transformers"`` (a ``PreTrainedModel`` held by the LightningModule) or ``"reference_llama"``.
        prefix: the attribute path of that model in the LightningModule, as a state-dict prefix (``"model."``);
            ``None``: found by matching the checkpoint's names against the model's.
        config: a ``transformers.PretrainedConfig`` or a reference :class:`LlamaConfig`.
        model_class: the ``transformers`` class for ``kind="transformers"``.
    """

    kind: Literal["transformers", "reference_llama"]
    prefix: str | None
    config: Any
    model_class: type | None = None


def _transformers_class(module: nn.Module) -> type | None:
    """The ``transformers`` class of ``module`` (FSDP2 wraps it in a subclass of its own, ``FSDPLlamaForCausalLM``)."""
    return next(
        (
            cls
            for cls in type(module).__mro__
            if cls.__module__.startswith("transformers.")
            and hasattr(cls, "config_class")
            and cls.__name__ != "PreTrainedModel"
        ),
        None,
    )


def describe_model(module: nn.Module) -> dict[str, Any] | None:
    """The export entry for a checkpoint of ``module`` (plain JSON types), or ``None`` if it holds no known model.

    The outermost Hugging Face ``PreTrainedModel`` or reference :class:`Llama` inside ``module`` is
    described by its attribute path, class and config.

    Example::

        describe_model(HFCausalLM("llama"))
        # {"kind": "transformers", "prefix": "model.", "class": "transformers....LlamaForCausalLM", "config": "{...}"}
    """
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if is_pretrained_model(sub):
            cls = _transformers_class(sub)
            if cls is None:
                continue
            return {
                "kind": "transformers",
                "prefix": prefix,
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "config": sub.config.to_json_string(use_diff=False),
            }
        if isinstance(sub, Llama):
            return {"kind": "reference_llama", "prefix": prefix, "config": asdict(sub.config)}
    return None


def allowed_model_class(path: object, checkpoint: object = "the checkpoint") -> type:
    """The ``transformers`` model class an ``hf_export`` entry names (``"transformers.models.llama.modeling_llama.
    LlamaForCausalLM"``), looked up among ``transformers``' top-level ``PreTrainedModel`` subclasses; ``ValueError``
    naming the class and ``checkpoint`` for anything else (no module is imported by the name it gives)."""
    import transformers

    name = path.rpartition(".")[2] if isinstance(path, str) else ""
    found = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
    if (
        isinstance(found, type)
        and issubclass(found, transformers.PreTrainedModel)
        and path in (f"{found.__module__}.{found.__qualname__}", f"transformers.{name}")
    ):
        return found
    raise ValueError(
        f"The 'hf_export' entry of {checkpoint} names the model class {path!r}, which is not one of transformers' "
        "model classes (PreTrainedModel subclasses exported by `transformers`); it was not imported. Pass the "
        "model's Hugging Face config instead: `lightning-llm export CKPT OUT --format hf --hf_config DIR`."
    )


def _from_hf_config(path: str | Path) -> ModelSource:
    import transformers

    path = Path(path)
    directory = path.parent if path.is_file() else path
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"--hf_config {str(path)!r} is neither a config.json nor a directory holding one; pass the Hugging Face "
            "directory the model was built from (or its config.json)."
        )
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:  # a config saved without `architectures`: the causal-LM class of its model type
        with torch.device("meta"):
            model_class = type(transformers.AutoModelForCausalLM.from_config(config))
    return ModelSource("transformers", None, config, model_class)


def resolve_source(rest: dict[str, Any], hf_config: str | Path | None = None, checkpoint: object = None) -> ModelSource:
    """Which model the checkpoint's tensors belong to: ``hf_config`` if given, else the checkpoint's own entry.

    ``rest`` is the checkpoint without its tensors (see :func:`lightning_llm.checkpointing.consolidate.read_model_state`).
    Raises ``ValueError`` naming the ways out when neither says, and naming ``checkpoint`` (its path) when its entry
    is malformed or names a class outside the allow-list (:func:`allowed_model_class`).
    """
    if hf_config is not None:
        return _from_hf_config(hf_config)
    entry = rest.get(EXPORT_KEY)
    where = checkpoint if checkpoint is not None else "the checkpoint"
    if entry is not None and (
        not isinstance(entry, dict) or entry.get("kind") not in ("transformers", "reference_llama")
    ):
        raise ValueError(
            f"The 'hf_export' entry of {where} is {entry!r:.200}, not one LLMParallelStrategy writes (a dict with kind "
            "'transformers' or 'reference_llama'). Pass the model's config: `--hf_config DIR`."
        )
    if entry is not None and entry["kind"] == "transformers":
        model_class = allowed_model_class(entry.get("class"), where)
        config = model_class.config_class.from_dict(json.loads(entry["config"]))
        return ModelSource("transformers", entry["prefix"], config, model_class)
    if entry is not None and entry["kind"] == "reference_llama":
        return ModelSource("reference_llama", entry["prefix"], LlamaConfig(**entry["config"]))
    config = reference_config((rest.get("hyper_parameters") or {}).get("config"))
    if config is not None:  # lightning_llm.models.CausalLM saved by any strategy
        return ModelSource("reference_llama", None, config)
    raise ValueError(
        "The checkpoint does not say which Hugging Face model its tensors belong to (no 'hf_export' entry, which "
        "LLMParallelStrategy writes, and no reference CausalLM config in its hyperparameters). Pass the Hugging "
        "Face config it was built from: `lightning-llm export CKPT OUT --format hf --hf_config DIR` (a directory "
        "with config.json, e.g. the one the model was loaded from), or export_hf(..., hf_config=DIR)."
    )

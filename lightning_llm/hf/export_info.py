"""What a Hugging Face export needs besides the tensors: which model, its config, where it sits in the module.

LLMParallelStrategy stores it in every checkpoint it saves (``checkpoint["hf_export"]``, from
:func:`describe_model`), so ``lightning-llm export CKPT OUT --format hf`` needs nothing else. For a
checkpoint saved by another strategy the export falls back to the reference model's
hyperparameters (``CausalLM(config=...)``), or to a Hugging Face config the user names
(``--hf_config DIR``: the directory the model was loaded from, or its ``config.json``).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

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
    transformers = sys.modules.get("transformers")  # a module cannot hold a PreTrainedModel without it imported
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if transformers is not None and isinstance(sub, transformers.PreTrainedModel):
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


def _import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


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


def resolve_source(rest: dict[str, Any], hf_config: str | Path | None = None) -> ModelSource:
    """Which model the checkpoint's tensors belong to: ``hf_config`` if given, else the checkpoint's own entry.

    ``rest`` is the checkpoint without its tensors (see :func:`lightning_llm.checkpointing.consolidate.read_model_state`).
    Raises ``ValueError`` naming the ways out when neither says.
    """
    if hf_config is not None:
        return _from_hf_config(hf_config)
    entry = rest.get(EXPORT_KEY)
    if entry is not None and entry["kind"] == "transformers":
        model_class = _import_class(entry["class"])
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

"""What LLMDeepSpeedStrategy refuses before DeepSpeed starts: a missing install, the wrong CPU accelerator, and
optimizers that need whole matrices."""

from __future__ import annotations

import torch

INSTALL_HINT = "pip install 'lightning_llm[deepspeed]'"


def require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"LLMDeepSpeedStrategy needs DeepSpeed, which could not be imported ({err}). "
            f"Install the extra: {INSTALL_HINT}"
        ) from err


def require_deepspeed_cpu_accelerator() -> None:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(
            f"Trainer(accelerator='cpu') with LLMDeepSpeedStrategy needs DeepSpeed's CPU accelerator, but DeepSpeed "
            f"selected {name!r}. Set the environment variable DS_ACCELERATOR=cpu before Python starts."
        )


def refuse_matrix_optimizers(optimizer) -> None:
    """Refuse, before the first step, an optimizer that needs whole matrices: DeepSpeed hands it flat partitions.

    ``torch.optim.Muon`` and :class:`~lightning_llm.optim.ShardedMuon` orthogonalize each 2-D gradient; under
    DeepSpeed they get flattened ZeRO partitions and fail inside their step ("Param gradient must be a 2D matrix").
    """
    from lightning_llm.optim import ShardedMuon

    muons = tuple(cls for cls in (getattr(torch.optim, "Muon", None), ShardedMuon) if cls is not None)
    if isinstance(optimizer, muons):
        package = "torch.optim" if type(optimizer).__module__.startswith("torch.") else "lightning_llm.optim"
        raise ValueError(
            f"{package}.{type(optimizer).__name__} cannot run under LLMDeepSpeedStrategy: "
            "DeepSpeed hands the optimizer flat ZeRO partitions, and Muon orthogonalizes whole 2-D matrices. Use "
            "LLMParallelStrategy with lightning_llm.optim.ShardedMuon (FSDP2, tensor and pipeline parallelism, "
            "where it matches one process), or AdamW under DeepSpeed."
        )

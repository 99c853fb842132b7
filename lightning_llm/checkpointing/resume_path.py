"""Is a ``ckpt_path`` a checkpoint this Trainer's strategy can read? Checked before fitting, naming the fix."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_llm.checkpointing import fs as cfs


def check_checkpoint_path(ckpt_path: str | Path | None, strategy) -> None:
    """Refuse a ``ckpt_path`` directory that is not a checkpoint, or one this strategy cannot read.

    Sharded (DCP) directories are read by Lightning's ModelParallel and FSDP strategies (and so
    LLMParallelStrategy); DeepSpeed directories have their own layout and are left to DeepSpeed.
    Files and names ("last", "best") are Lightning's to resolve. ``lightning-llm fit`` runs it before
    fitting; Lightning's own Trainer gives user code no hook between ``fit(ckpt_path=...)`` and the load.
    """
    if ckpt_path is None or ckpt_path in ("last", "best", "hpc") or isinstance(strategy, DeepSpeedStrategy):
        return
    path = str(ckpt_path)  # a local path or an fsspec URL (ValueError naming an unknown protocol)
    if not cfs.isdir(path):
        return
    sharded_loader = isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))
    if not cfs.isfile(cfs.join(path, ".metadata")):
        raise ValueError(
            f"ckpt_path={path!r} is a directory but not a checkpoint (no .metadata file inside). Pass a "
            "checkpoint file or a sharded checkpoint directory saved by LLMParallelStrategy."
        )
    if not sharded_loader:
        raise ValueError(
            f"ckpt_path={path!r} is a sharded checkpoint directory, which this Trainer's strategy cannot "
            "load. Resume with strategy=LLMParallelStrategy(...) (any number of devices), or first write one file "
            f"with `python -m lightning_llm.checkpoint {path} full.ckpt`."
        )

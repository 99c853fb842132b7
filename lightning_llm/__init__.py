"""lightning_llm: Lightning strategies and callbacks for training large language models.

Example::

    import lightning as L
    from lightning_llm import CheckpointRotation, LLMParallelStrategy, MFUMonitor

    trainer = L.Trainer(devices=8, strategy=LLMParallelStrategy(tensor_parallel_size=2, zero_stage=3),
                        callbacks=[MFUMonitor(), CheckpointRotation(keep_last=3)])
"""

from importlib.metadata import PackageNotFoundError, version

from lightning_llm.callbacks import (
    CheckpointRotation,
    GradNormMonitor,
    LossSpikeError,
    LossSpikeGuard,
    MFUMonitor,
    RankUnresponsiveError,
    RankWatchdog,
)
from lightning_llm.contract import ParallelLayout, StrategyContract, contract_of
from lightning_llm.strategies import LLMDeepSpeedStrategy, LLMParallelStrategy

try:
    __version__ = version("lightning_llm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "CheckpointRotation",
    "GradNormMonitor",
    "LLMDeepSpeedStrategy",
    "LLMParallelStrategy",
    "LossSpikeError",
    "LossSpikeGuard",
    "MFUMonitor",
    "ParallelLayout",
    "RankUnresponsiveError",
    "RankWatchdog",
    "StrategyContract",
    "__version__",
    "contract_of",
]

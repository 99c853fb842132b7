"""Callbacks: a progress bar and model summary for LLM runs, throughput and MFU, gradient norms, memory, mixture-of-experts load, the run's layout in the loggers, loss-spike guarding, crash-safe checkpoint rotation, a rank watchdog, resume checks."""

from lightning_llm.callbacks.checkpoint import CheckpointRotation
from lightning_llm.callbacks.console import LLMModelSummary, StepBudgetProgressBar
from lightning_llm.callbacks.grad_norm import GradNormMonitor
from lightning_llm.callbacks.memory import MemoryMonitor, RunInfoLogger
from lightning_llm.callbacks.mfu import MFUMonitor
from lightning_llm.callbacks.moe import MoEMonitor
from lightning_llm.callbacks.resume import ResumeChecks
from lightning_llm.callbacks.spike import LossSpikeError, LossSpikeGuard
from lightning_llm.callbacks.watchdog import RankUnresponsiveError, RankWatchdog

__all__ = [
    "CheckpointRotation",
    "GradNormMonitor",
    "LLMModelSummary",
    "LossSpikeError",
    "LossSpikeGuard",
    "MFUMonitor",
    "MemoryMonitor",
    "MoEMonitor",
    "RankUnresponsiveError",
    "RankWatchdog",
    "ResumeChecks",
    "RunInfoLogger",
    "StepBudgetProgressBar",
]

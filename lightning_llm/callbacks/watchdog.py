"""RankWatchdog: when a collective times out, name the ranks that stopped responding."""

from __future__ import annotations

import re
from datetime import timedelta

import lightning as L
import torch.distributed as dist
from typing_extensions import override

from lightning_llm.validation import check_float


class RankUnresponsiveError(RuntimeError):
    """A collective timed out and the watchdog found which ranks did not answer."""


class RankWatchdog(L.Callback):
    """Turn a collective timeout into an error that names the ranks that stopped responding.

    A rank that hangs (a deadlock, a stuck file system, a debugger) leaves the others waiting in
    their next collective until the process group's ``timeout`` (see ``LLMParallelStrategy(timeout=...)``),
    and the timeout error itself does not say which rank is missing. When training fails with a
    timeout, every responsive rank enters torch's ``dist.monitored_barrier`` on a gloo group of the
    watchdog's own (gloo, so it works beside NCCL too); rank 0 learns which ranks never arrive and
    raises :class:`RankUnresponsiveError` naming them. It costs nothing while training runs.
    For NCCL, torch's flight recorder adds per-collective traces: set ``TORCH_NCCL_TRACE_BUFFER_SIZE``
    (e.g. 2000) and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` in the job's environment.

    Arguments:
        timeout: seconds the barrier waits for the other ranks after the timeout.

    Example::

        trainer = L.Trainer(devices=8, strategy=LLMParallelStrategy(timeout=300), callbacks=[RankWatchdog()])
    """

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timedelta(seconds=check_float("timeout", timeout, minimum=0, inclusive=False))
        self._group = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._group is None or isinstance(exception, RankUnresponsiveError) or not _is_timeout(exception):
            return
        try:
            dist.monitored_barrier(group=self._group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(err))
            who = f"rank {found.group(1).strip()} stopped responding" if found else "another rank stopped responding"
            raise RankUnresponsiveError(
                f"A collective timed out on rank {dist.get_rank()}: {who} (hung, not crashed; no answer within "
                f"{self.timeout.total_seconds():g} s). Inspect it, e.g. `py-spy dump --pid <its pid>`. torch: {err}"
            ) from exception


def _is_timeout(exception: BaseException) -> bool:
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and ("timed out" in text or "timeout" in text)

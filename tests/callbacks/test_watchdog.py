"""RankWatchdog + the strategy's collective timeout: a rank that hangs (sleeps, not killed) makes the others fail
within the configured timeout, with a message naming the hung rank."""

import json
import os
import time
from pathlib import Path

import lightning as L
import pytest

from lightning_llm.callbacks import RankUnresponsiveError, RankWatchdog
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from lightning_llm.testing.distributed import DistributedTestError

TIMEOUT, SLEEP = 3.0, 16.0


class _Hang(L.Callback):
    """Rank 1 stops responding at step 2 (a sleep, as a deadlock or a stuck file system would)."""

    def __init__(self):
        self.started = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            self.started = time.monotonic()
            if trainer.global_rank == 1:
                time.sleep(SLEEP)
                os._exit(3)  # the hang is over: end this rank at once rather than wait out its broken collectives


def _run_with_a_hung_rank(report: str):
    L.seed_everything(0)  # the model is initialized on each rank's shards from the same generator state
    hang = _Hang()
    trainer = cpu_trainer(
        devices=2,
        strategy=LLMParallelStrategy(zero_stage=0, timeout=TIMEOUT),
        max_steps=4,
        callbacks=[hang, RankWatchdog(timeout=TIMEOUT)],
        limit_val_batches=0,
    )
    try:
        trainer.fit(
            CausalLM("tiny", warmup_steps=1, max_steps=4), LLMDataModule(num_tokens=5_000, seq_len=32, batch_size=2)
        )
    except BaseException as err:
        result = [type(err).__name__, str(err), time.monotonic() - hang.started]
    else:
        result = [None, "", 0.0]
    Path(report).write_text(json.dumps(result))  # rank 1 exits without reporting, so rank 0 writes a file


@pytest.mark.distributed
def test_a_hung_rank_is_named_within_the_timeout(tmp_path):
    with pytest.raises(DistributedTestError, match=r"Ranks \[1\] died"):
        run_distributed(_run_with_a_hung_rank, 2, str(tmp_path / "rank0.json"), timeout=180)
    kind, message, waited = json.loads((tmp_path / "rank0.json").read_text())
    assert kind == RankUnresponsiveError.__name__, message
    assert "rank 1 stopped responding" in message
    # The collective timeout, then the watchdog's barrier timeout; far less than the hang (and torch's 30 minutes).
    print(f"rank 0 failed {waited:.1f} s after rank 1 hung")
    assert waited < 2 * TIMEOUT + 6 < SLEEP, waited


def test_timeouts_are_checked():
    with pytest.raises(ValueError, match="timeout=-5 must be a number > 0"):
        LLMParallelStrategy(timeout=-5)
    with pytest.raises(ValueError, match="timeout=0 must be a number > 0"):
        RankWatchdog(timeout=0)
    assert LLMParallelStrategy()._timeout.total_seconds() == 600  # the documented training default

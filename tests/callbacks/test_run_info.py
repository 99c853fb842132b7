"""One logging cadence, memory metrics and the run's layout in the loggers (W&B offline, read back)."""

import json

import lightning as L
import pytest
from lightning.pytorch.loggers import WandbLogger

from lightning_llm.callbacks import GradNormMonitor, LossSpikeGuard, MemoryMonitor, MFUMonitor, RunInfoLogger
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.planning.zero import NATIVE_OPTIONS
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests._optional import requires_wandb
from tests.callbacks.test_logging import Capture

OURS = ("train/", "grad_norm/", "memory/", "loss_guard/")


class Hyperparameters(Capture):
    def __init__(self) -> None:
        super().__init__()
        self.params: dict = {}

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self.params.update(params if isinstance(params, dict) else vars(params))


def _fit(logger, callbacks, steps: int, log_every: int, **trainer_kwargs) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        log_every_n_steps=log_every,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4))


def test_every_callback_logs_on_the_trainers_steps_only():
    capture = Hyperparameters()
    callbacks = [MFUMonitor(peak_flops=1e12), GradNormMonitor(), LossSpikeGuard(), MemoryMonitor(), RunInfoLogger()]
    _fit(capture, callbacks, steps=8, log_every=3, accumulate_grad_batches=2)
    # Lightning logs after optimizer steps 3 and 6 (logger steps 2 and 5); hand-computed, not asked of the code.
    for prefix in OURS:
        steps = sorted({step for step, row in capture.rows if any(key.startswith(prefix) for key in row)})
        assert steps == [2, 5], (prefix, steps)
    memory = [row for _, row in capture.rows if "memory/rss_gib" in row]
    params_gib = sum(p.numel() * 4 for p in CausalLM("tiny").parameters()) / 2**30
    assert all(params_gib < row["memory/rss_gib"] <= row["memory/max_rss_gib"] for row in memory)
    layout = {key: value for key, value in capture.params.items() if key.startswith("parallel/")}
    assert layout["parallel/world_size"] == 1 and layout["parallel/tp"] == 1 and layout["parallel/pp"] == 1
    assert layout["parallel/activation_checkpointing"] == "none"


def test_an_interval_that_is_not_a_multiple_of_the_trainers_is_warned_about():
    with pytest.warns(
        UserWarning, match=r"MFUMonitor\(log_every_n_steps=4\) is not a multiple of .*log_every_n_steps=3"
    ):
        _fit(Hyperparameters(), [MFUMonitor(log_every_n_steps=4, peak_flops=1e12)], steps=2, log_every=3)


def _fit_logging_to_wandb(save_dir: str) -> None:
    """One offline W&B run in a fresh process: W&B writes a second run of a process lazily, if at all."""
    import os

    import wandb

    os.environ["WANDB_MODE"] = "offline"
    logger = WandbLogger(project="lightning-llm-test", save_dir=save_dir)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        log_every_n_steps=1,
        logger=logger,
        strategy=LLMParallelStrategy(zero_stage="auto", device_memory="1GB"),
        callbacks=[MemoryMonitor(), RunInfoLogger()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4))
    wandb.finish()


@pytest.mark.timeout(300)
@requires_wandb
def test_layout_memory_and_the_zero_plan_reach_an_offline_wandb_run(tmp_path):
    run_distributed(_fit_logging_to_wandb, 1, str(tmp_path), timeout=240)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    written = b"".join(f.read_bytes() for f in run_dir.glob("*.wandb"))
    for key in ("parallel/world_size", "parallel/zero_stage", "zero_stage", "memory/rss_gib", "plan/zero_stage"):
        assert key.encode() in written, key
    (table_file,) = run_dir.glob("files/media/table/plan/zero_stage*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:2] == ["zero_stage", "offload"] and "chosen" in table["columns"]
    chosen = [row for row in table["data"] if row[table["columns"].index("chosen")]]
    assert len(table["data"]) == len(NATIVE_OPTIONS) and len(chosen) == 1  # every option planned, one chosen
    assert chosen[0][table["columns"].index("fits")]

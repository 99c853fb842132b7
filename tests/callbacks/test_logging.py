"""Every monitoring metric reaches W&B (offline run, read back from its files) and a CSV log."""

import csv

import lightning as L
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_llm.callbacks import GradNormMonitor, LossSpikeGuard, MFUMonitor
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from tests.callbacks._wandb_records import history

EXPECTED = {
    "throughput/tokens_per_sec", "throughput/samples_per_sec", "throughput/tflops_per_device", "throughput/mfu",
    "grad_norm/total", "grad_norm/clipped", "grad_norm/block_0", "loss_guard/nonfinite", "loss_guard/spikes",
    "loss_guard/skipped", "train_loss",
}


def test_metrics_reach_wandb_offline_and_csv(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_logger = WandbLogger(project="lightning-llm-test", save_dir=str(tmp_path))
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, log_every_n_steps=1, gradient_clip_val=1.0, logger=[wandb_logger, csv_logger],
        callbacks=[MFUMonitor(log_every_n_steps=2, peak_flops=1e12), GradNormMonitor(per_block=True), LossSpikeGuard()],
        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
    )
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4))
    wandb.finish()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history(run_file)
    logged = {key for row in rows for key in row}
    assert EXPECTED <= logged, sorted(EXPECTED - logged)
    assert all(0 < row["throughput/mfu"] < 1 for row in rows if "throughput/mfu" in row)
    assert len([row for row in rows if "grad_norm/total" in row]) == 6

    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert EXPECTED <= columns, sorted(EXPECTED - columns)
    logged_norms = [float(r["grad_norm/total"]) for r in rows if r["grad_norm/total"]]
    assert len(logged_norms) == 6, "one gradient norm per optimizer step"

"""Every monitoring metric reaches Lightning's loggers: a capturing logger, a CSV log and an offline W&B run."""

import csv

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

from lightning_llm.callbacks import GradNormMonitor, LossSpikeGuard, MFUMonitor
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from tests._optional import requires_wandb
from tests._wandb_file import read_when

EXPECTED = {
    "train/items_per_sec",
    "train/samples_per_sec",
    "train/device/flops_per_sec",
    "train/flops_per_sec",
    "train/device/mfu",
    "grad_norm/total",
    "grad_norm/was_clipped",
    "grad_norm/block_0",
    "loss_guard/nonfinite",
    "loss_guard/spikes",
    "loss_guard/skipped",
    "train_loss",
}


class Capture(Logger):
    """Keeps every ``log_metrics`` call: what any Lightning logger (W&B included) is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


@requires_wandb
def test_metrics_reach_every_logger(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    capture, csv_logger = Capture(), CSVLogger(str(tmp_path), name="csv")
    wandb_logger = WandbLogger(project="lightning-llm-test", save_dir=str(tmp_path))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        log_every_n_steps=1,
        gradient_clip_val=1.0,
        logger=[capture, csv_logger, wandb_logger],
        callbacks=[MFUMonitor(log_every_n_steps=2, peak_flops=1e12), GradNormMonitor(per_block=True), LossSpikeGuard()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4))
    wandb.finish()

    logged = {key for _, row in capture.rows for key in row}
    assert logged >= EXPECTED, sorted(EXPECTED - logged)
    assert all(0 < row["train/device/mfu"] < 1 for _, row in capture.rows if "train/device/mfu" in row)
    assert [step for step, row in capture.rows if "grad_norm/total" in row] == list(range(6)), "once per step"

    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) >= EXPECTED, sorted(EXPECTED - set(rows[0]))
    assert len([r for r in rows if r["grad_norm/total"]]) == 6, "one gradient norm per optimizer step"

    # End to end: the offline run W&B wrote holds every metric name (its record format is W&B's own).
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")

    def missing(data: bytes) -> list[str]:
        return sorted(key for key in EXPECTED if key.encode() not in data)

    assert not missing(written := read_when(run_file, lambda data: not missing(data))), missing(written)

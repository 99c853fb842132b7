import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM


class _RecordBatches(L.Callback):
    def __init__(self):
        self.batches, self.losses = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch[:, :4].clone())
        self.losses.append(outputs["loss"].item())


def _trainer(max_steps, callbacks, root):
    return L.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, default_root_dir=root, num_sanity_val_steps=0, limit_val_batches=0,
    )


def _data():
    # 30 batches an epoch: 20 steps stay inside epoch 0, so resuming at 10 is mid-epoch.
    return LLMDataModule(num_tokens=30 * 4 * 32 + 1, seq_len=32, batch_size=4, seed=7)


def test_resumed_run_continues_with_the_next_batch_and_same_losses(tmp_path):
    # A checkpoint written mid-epoch at step 10 of a 20-step run, as after a crash.
    L.seed_everything(0)
    straight = _RecordBatches()
    every_10 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    _trainer(20, [straight, every_10], tmp_path).fit(CausalLM("tiny", warmup_steps=5, max_steps=20), _data())

    L.seed_everything(123)  # the resumed run must not depend on the seed it starts with
    resumed = _RecordBatches()
    _trainer(20, [resumed], tmp_path).fit(
        CausalLM("tiny", warmup_steps=5, max_steps=20), _data(), ckpt_path=tmp_path / "epoch=0-step=10.ckpt"
    )

    assert len(resumed.batches) == 10
    for step, (got, want) in enumerate(zip(resumed.batches, straight.batches[10:]), start=10):
        assert torch.equal(got, want), f"step {step} read a different batch after resume"
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses[10:]), rtol=1e-6, atol=0)

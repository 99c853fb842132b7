"""Resume exactness on one process: mid-epoch checkpoints, across epoch boundaries, bitwise."""

from collections import Counter

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM

STEPS = 20


class _RecordBatches(L.Callback):
    def __init__(self):
        self.batches, self.losses, self.epochs = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch[:, :4].clone())
        self.losses.append(outputs["loss"].item())
        self.epochs.append(trainer.current_epoch)


def _trainer(max_steps, callbacks, root):
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def _data():
    # 7 batches an epoch: 20 steps cross two epoch boundaries (after steps 7 and 14).
    return LLMDataModule(num_tokens=7 * 4 * 32 + 1, seq_len=32, batch_size=4, seed=7)


def _model():
    return CausalLM("tiny", warmup_steps=5, max_steps=STEPS)


def _fit(until, root, resume_from=None, seed=0):
    L.seed_everything(seed)
    record, model = _RecordBatches(), _model()
    callbacks = [record]
    if until < STEPS:  # written from inside the loop, as a periodic save of a run that then dies
        callbacks.append(
            ModelCheckpoint(dirpath=root, filename=f"step{until}", every_n_train_steps=until, save_top_k=-1)
        )
    _trainer(until, callbacks, root).fit(model, _data(), ckpt_path=resume_from)
    return record, model


def test_three_interruptions_across_epoch_boundaries_match_a_straight_run_bitwise(tmp_path):
    straight, straight_model = _fit(STEPS, tmp_path / "straight")
    assert Counter(straight.epochs) == {0: 7, 1: 7, 2: 6}

    # Interrupted mid-epoch in epoch 0 (step 5), epoch 1 (step 10) and epoch 2 (step 16).
    pieces, previous = [], None
    for index, until in enumerate([5, 10, 16, STEPS]):
        # The first piece initialises like the straight run; each resumed one starts from another seed, since
        # nothing may depend on the seed a resumed run happens to start with.
        record, model = _fit(until, tmp_path / "pieces", resume_from=previous, seed=100 + index if index else 0)
        pieces.append(record)
        previous = tmp_path / "pieces" / f"step{until}.ckpt"

    epochs = [e for p in pieces for e in p.epochs]
    assert Counter(epochs) == Counter(straight.epochs), "every epoch must keep its number of batches after a resume"
    assert epochs == straight.epochs
    batches = [b for p in pieces for b in p.batches]
    for step, (got, want) in enumerate(zip(batches, straight.batches, strict=True)):
        assert torch.equal(got, want), f"step {step} read a different batch after resume"
    assert [x for p in pieces for x in p.losses] == straight.losses  # bitwise
    for (name, got), want in zip(model.state_dict().items(), straight_model.state_dict().values(), strict=True):
        assert torch.equal(got, want), f"{name} differs from the straight run"

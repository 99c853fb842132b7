"""ResumeChecks: what a resume under Lightning's own strategies would do silently, refused or said.

This package's strategies check their checkpoints as they load them and say what the restore replaced; under
Lightning's own (single device, DDP) nothing does. This callback does, for those runs (``lightning-llm fit`` adds it):

* a checkpoint saved with untied weights, resumed into a model that ties them (``tie_embeddings=True``), is refused
  before the first step (loading it would keep one of the two tensors silently);
* a learning rate, or any optimizer or scheduler setting, that the checkpoint's restored state replaced is said in
  one warning (:mod:`lightning_llm.checkpointing.resumed_settings`).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lightning_llm.checkpointing import resumed_settings
from lightning_llm.modeling.tied import differing, refuse_untied, tied_groups


class ResumeChecks(L.Callback):
    """Refuses an untied checkpoint for a tied model, and says what the resume's restored state overrode.

    Example::

        trainer = L.Trainer(strategy="ddp", callbacks=[ResumeChecks()])
        trainer.fit(model, data, ckpt_path="last.ckpt")
    """

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resumed_settings.remember(trainer)  # the optimizers are built; the checkpoint's state is not restored yet

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resumed_settings.report(trainer)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):  # a full checkpoint; a sharded one was checked by the strategy that loaded it
            refuse_untied(differing(tied_groups(pl_module.state_dict()), state), str(trainer.ckpt_path))

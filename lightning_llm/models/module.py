"""The reference model as an ordinary LightningModule.

Nothing here knows about lightning_llm's strategies: it is the kind of module a user
already has, and the strategies must train it unchanged.
"""

from __future__ import annotations

import inspect
import math

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from lightning_llm.models.cross_entropy import head_cross_entropy, vocab_parallel
from lightning_llm.models.llama import Llama, LlamaConfig
from lightning_llm.models.moe import MoEFeedForward, Router, update_expert_biases
from lightning_llm.models.presets import PRESETS
from lightning_llm.validation import check_bool, check_float, check_int


def _check_hyperparameters(learning_rate, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio) -> None:
    """The optimizer and schedule arguments' types and ranges, each named (``learning_rate="3e-4"`` from a
    hand-written dict would reach AdamW as a string)."""
    check_float("learning_rate", learning_rate, minimum=0)
    check_float("weight_decay", weight_decay, minimum=0)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas={betas!r} must be two numbers (beta1, beta2), e.g. (0.9, 0.95).")
    for i, beta in enumerate(betas):
        if check_float(f"betas[{i}]", beta, minimum=0, maximum=1) == 1:
            raise ValueError(f"betas[{i}]={beta!r} must be below 1 (AdamW's running averages would never decay).")
    check_int("warmup_steps", warmup_steps, minimum=0)
    check_int("max_steps", max_steps, minimum=1, optional=True)
    check_float("min_lr_ratio", min_lr_ratio, minimum=0, maximum=1)


def _check_loss_options(fused_cross_entropy, loss_chunk_size) -> None:
    check_bool("fused_cross_entropy", fused_cross_entropy)
    check_int("loss_chunk_size", loss_chunk_size, minimum=1, optional=True)


class CausalLM(L.LightningModule):
    """Next-token prediction with a :class:`Llama` model and the usual LLM optimizer recipe.

    Batches are integer tensors of shape (batch, seq_len + 1): inputs are all but the
    last token, targets all but the first. A dict batch ``{"input_ids", "document_ids"}``
    (``LLMDataModule(return_document_ids=True)``) trains with document-masked attention: no
    token attends across a document boundary of a packed sample. Logs ``train_loss``/``train_ppl`` every step
    and ``val_loss``/``val_ppl`` per validation run.

    Arguments:
        config: a preset name from ``lightning_llm.models.presets.PRESETS`` or a full :class:`LlamaConfig`.
        learning_rate: peak learning rate of AdamW.
        weight_decay: decoupled weight decay for matrices; norms and biases get none.
        betas: AdamW betas (0.9, 0.95) as in GPT-3 and Llama.
        warmup_steps: linear warmup from 0 to ``learning_rate``.
        max_steps: steps of the cosine decay to ``min_lr_ratio * learning_rate``; ``None`` takes the
            Trainer's estimate of the run length.
        min_lr_ratio: final learning rate as a fraction of the peak.
        fused_cross_entropy: compute the head and the loss together in chunks of tokens, so the logits are never
            whole (:func:`~lightning_llm.models.cross_entropy.linear_cross_entropy`; Liger-Kernel's kernel on CUDA
            where it is installed). The same loss and gradients as ``F.cross_entropy`` on the logits, without the
            largest activation of the step. Not used where tensor parallelism splits the head's vocabulary (its
            gathered logits and ``F.cross_entropy`` then, as with ``False``).
        loss_chunk_size: tokens per chunk of the fused loss; ``None``: an eighth of the tokens, at most 512 MiB of
            fp32 logits per chunk, all of them where they fit
            (:func:`~lightning_llm.models.cross_entropy.default_chunk_size`).

    Example::

        model = CausalLM("tiny", learning_rate=1e-3)
        trainer = L.Trainer(max_steps=100)
        trainer.fit(model, LLMDataModule())
    """

    def __init__(
        self,
        config: str | LlamaConfig = "tiny",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        fused_cross_entropy: bool = True,
        loss_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        _check_hyperparameters(learning_rate, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio)
        _check_loss_options(fused_cross_entropy, loss_chunk_size)
        self.fused_cross_entropy, self.loss_chunk_size = fused_cross_entropy, loss_chunk_size
        if isinstance(config, dict):  # hyperparameters saved as a dict (lightning_llm.cli.data_vocab)
            config = LlamaConfig(**config)
        if not isinstance(config, (str, LlamaConfig)):
            raise TypeError(
                f"config={config!r} must be a preset name (one of {sorted(PRESETS)}), a LlamaConfig or a dict of "
                f"its fields, got {type(config).__name__}."
            )
        self.config = LlamaConfig.from_name(config) if isinstance(config, str) else config
        self.model: Llama | None = None
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        # Built here rather than in __init__ so the strategy's init context decides the device: under
        # LLMParallelStrategy it is the meta device, and each rank later allocates only its shards and runs
        # Llama.reset_parameters on them (lightning_llm.parallel.init.materialize). Under other strategies it
        # is built eagerly on the host, unless wrapped in `trainer.init_module(empty_init=True)`.
        if self.model is None:
            self.model = Llama(self.config)

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, return_hidden: bool = False
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab), or with ``return_hidden`` the final hidden states (batch, seq, dim)."""
        kwargs = {"return_hidden": True} if return_hidden else {}
        return self.model(tokens, **kwargs) if document_ids is None else self.model(tokens, document_ids, **kwargs)

    def _loss(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        tokens, documents = (
            (batch["input_ids"], batch.get("document_ids")) if isinstance(batch, dict) else (batch, None)
        )
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        documents = None if documents is None else documents[:, :-1]
        # Document ids only where there are some: a subclass's forward(tokens) keeps working.
        args = (inputs,) if documents is None else (inputs, documents)
        if self._fuses_loss():
            hidden = self(*args, return_hidden=True)
            return head_cross_entropy(self.model.output, hidden, targets, chunk_size=self.loss_chunk_size)
        logits = self(*args)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _fuses_loss(self) -> bool:
        """Whether the chunked loss applies: asked for, the head's vocabulary whole on this rank (off a pipeline's
        last stage the head is a placeholder without weight, and the forward stops before it anyway), and a
        ``forward`` that can return hidden states (a subclass's own ``forward`` without ``return_hidden`` keeps the
        logits path)."""
        if not self.fused_cross_entropy or vocab_parallel(getattr(self.model.output, "weight", None)):
            return False
        return "return_hidden" in inspect.signature(self.forward).parameters

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", loss.detach().exp())
        aux = [m.aux_loss for m in self.model.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
        if aux:  # mixture-of-experts load balancing (moe_aux_loss_coef > 0)
            aux_loss = torch.stack(aux).sum()
            self.log("train_moe_aux_loss", aux_loss.detach())
            loss = loss + aux_loss
        return loss

    def on_train_start(self) -> None:
        # Routes counted by forwards during setup (a pipeline stage's shape inference, planning) are not a step's.
        for module in self.model.modules() if self.model is not None else ():
            if isinstance(module, Router) and module.bias_update_rate:
                module.tokens_per_expert.zero_()

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.config.moe_bias_update_rate and self.model is not None:  # auxiliary-loss-free balancing, every rank
            update_expert_biases(self.model, self.config.n_layers, self.config.n_experts)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), weight=_samples(batch))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # already reduced over ranks by torchmetrics
        self.val_loss.reset()
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)  # same value everywhere; silences Lightning's warning
        self.log("val_ppl", loss.exp(), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), weight=_samples(batch))

    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_ppl", loss.exp(), sync_dist=True)

    def configure_optimizers(self):
        # Matrices decay, vectors (norms, biases) do not. A DeepSpeed ZeRO-3 parameter built inside fit is an empty
        # 1-D stand-in whose full shape is `ds_shape`: read by its `dim()`, every parameter would be a vector.
        matrix = {id(p) for p in self.parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2}
        decay = [p for p in self.parameters() if p.requires_grad and id(p) in matrix]
        no_decay = [p for p in self.parameters() if p.requires_grad and id(p) not in matrix]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
            betas=tuple(self.hparams.betas),
            # One fused kernel per step on GPUs instead of a dozen foreach launches (torchtitan's default too).
            fused=all(p.device.type == "cuda" for p in self.parameters()) or None,
        )
        total = self.hparams.max_steps or self.trainer.estimated_stepping_batches
        schedule = warmup_cosine(self.hparams.warmup_steps, int(total), self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _samples(batch: torch.Tensor | dict[str, torch.Tensor]) -> int:
    return (batch["input_ids"] if isinstance(batch, dict) else batch).shape[0]


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier

"""Private Lightning APIs: the sharded-checkpoint layout, optimizer moves, dataloader rebuilding, process-group
teardown, the fit loop's data source, and the loggers' and progress bar's internals.

The attributes of the strategies our subclasses extend (``ModelParallelStrategy``, ``DeepSpeedStrategy``) are in
:mod:`.lightning_strategies`."""

from __future__ import annotations

from typing import Any

from lightning_llm._compat.registry import Private, has_instance_attr, register, resolve

CHECKED = "lightning 2.6.6"

from lightning.fabric.utilities.load import _METADATA_FILENAME  # noqa: E402  (a constant since lightning 2.1)

METADATA_FILENAME: str = _METADATA_FILENAME
"""Lightning's ``_METADATA_FILENAME`` (``"meta.pt"``): the non-tensor part of a sharded (DCP) checkpoint directory,
so the project reads and writes the layout Lightning's ``ModelParallelStrategy`` uses. Checked on lightning 2.6.6."""

register(
    Private(
        name="lightning.fabric.utilities.load._METADATA_FILENAME",
        upstream="lightning",
        accessor="lightning.METADATA_FILENAME",
        used_by=("checkpointing/dcp.py", "checkpointing/consolidate.py"),
        why="read and write the same sharded layout Lightning's ModelParallelStrategy uses",
        caught_by="`tests/strategies/test_parallel_strategy.py` (consolidation), `tests/callbacks/test_checkpoint_rotation.py`",
        checked=CHECKED,
        check=lambda: resolve("lightning.fabric.utilities.load:_METADATA_FILENAME"),
    )
)


def optimizers_to_device(optimizers, device) -> None:
    """Lightning's ``_optimizers_to_device``: move restored optimizer state to ``device``, as Lightning's own
    strategies do after loading; no public helper. Checked on lightning 2.6.6."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


register(
    Private(
        name="lightning.fabric.utilities.optimizer._optimizers_to_device",
        upstream="lightning",
        accessor="lightning.optimizers_to_device",
        used_by=("strategies/parallel.py",),
        why="move restored optimizer state, as Lightning's own strategies do",
        caught_by="resume tests in `tests/strategies/test_parallel_strategy.py`",
        checked=CHECKED,
        check=lambda: resolve("lightning.fabric.utilities.optimizer:_optimizers_to_device"),
    )
)


def rebuild_dataloader(dataloader, sampler):
    """Lightning's ``_update_dataloader``: the same DataLoader (its subclass and constructor arguments) over another
    sampler, what Lightning does when it injects its ``DistributedSampler``; no public helper. Checked on lightning
    2.6.6."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


register(
    Private(
        name="lightning.pytorch.utilities.data._update_dataloader",
        upstream="lightning",
        accessor="lightning.rebuild_dataloader",
        used_by=("data/resume.py",),
        why="rebuild a user's training DataLoader over a sampler that skips the batches a resumed epoch already "
        "trained, as Lightning rebuilds it to inject its DistributedSampler",
        caught_by="`tests/data/test_user_datamodule_resume.py`",
        checked=CHECKED,
        check=lambda: resolve("lightning.pytorch.utilities.data:_update_dataloader"),
    )
)


def materialize_distributed_module(module, device) -> None:
    """Lightning's ``_materialize_distributed_module``: ``to_empty`` then every submodule's ``reset_parameters``,
    what ``ModelParallelStrategy`` does to a meta model its ``configure_model`` parallelized by hand; used for that
    same case, so a swap initializes such a model as Lightning does. Checked on lightning 2.6.6."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


register(
    Private(
        name="lightning.fabric.utilities.init._materialize_distributed_module",
        upstream="lightning",
        accessor="lightning.materialize_distributed_module",
        used_by=("strategies/parallel.py",),
        why="a configure_model that parallelized a meta model by hand is materialized as ModelParallelStrategy does",
        caught_by="`tests/lightning_compat/test_model_parallel_integration.py` (Lightning's own tests, empty_init=True)",
        checked=CHECKED,
        check=lambda: resolve("lightning.fabric.utilities.init:_materialize_distributed_module"),
    )
)


def destroy_dist_connection() -> None:
    """Lightning's ``_destroy_dist_connection``: the process-group teardown Lightning registers at exit (for NCCL
    only); registered for gloo too. Checked on lightning 2.6.6."""
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    _destroy_dist_connection()


register(
    Private(
        name="lightning.fabric.utilities.distributed._destroy_dist_connection",
        upstream="lightning",
        accessor="lightning.destroy_dist_connection",
        used_by=("parallel/shutdown.py",),
        why="the process-group teardown Lightning registers at exit for NCCL only, registered for gloo too (then a "
        "garbage collection so gloo's threads are joined before finalization)",
        caught_by="`tests/multinode/test_two_nodes.py` (torchrun exit codes)",
        checked=CHECKED,
        check=lambda: resolve("lightning.fabric.utilities.distributed:_destroy_dist_connection"),
    )
)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` wrapper (its ``_optimizer``), or ``optimizer`` itself
    when it has none. ``LightningOptimizer.optimizer`` is the public name, but any wrapper keeping ``_optimizer``
    (Fabric's too) is unwrapped the same way here. Checked on lightning 2.6.6."""
    return getattr(optimizer, "_optimizer", optimizer)


register(
    Private(
        name="LightningOptimizer._optimizer",
        upstream="lightning",
        accessor="lightning.unwrap_optimizer",
        used_by=("checkpointing/dcp.py",),
        why="the real optimizer for DCP's `get/set_optimizer_state_dict` (which key by the optimizer's own param "
        "groups), unwrapping any Lightning wrapper",
        caught_by="resume tests in `tests/strategies/test_parallel_strategy.py`",
        checked=CHECKED,
        check=lambda: has_instance_attr("lightning.pytorch.core.optimizer:LightningOptimizer", "_optimizer"),
    )
)


def fit_loop_data_source(trainer) -> Any:
    """``trainer.fit_loop._data_source``: where the fit loop gets its training dataloader (the dataloaders passed to
    ``fit()``, or the datamodule/module hooks); Lightning loads it only after ``setup``, and no public API exposes
    it before. Checked on lightning 2.6.6."""
    return trainer.fit_loop._data_source


register(
    Private(
        name="trainer.fit_loop._data_source",
        upstream="lightning",
        accessor="lightning.fit_loop_data_source",
        used_by=("strategies/zero_auto.py",),
        why='one example batch for "auto" planning when dataloaders are passed straight to `fit()` (Lightning loads '
        "them only after `setup`)",
        caught_by='`tests/parallel/test_activation_checkpointing.py` ("auto" through the strategy), `tests/planning/test_zero.py`',
        checked=CHECKED,
        check=lambda: has_instance_attr("lightning.pytorch.loops.fit_loop:_FitLoop", "_data_source"),
    )
)


register(
    Private(
        name="RichProgressBar._get_train_description",
        upstream="lightning",
        accessor="(overridden, not called: callbacks/console.StepBudgetProgressBar)",
        used_by=("callbacks/console.py",),
        why="the progress bar's description of a run bounded by max_steps (Lightning prints `Epoch 0/-2`); the one "
        "method that builds it, no public hook",
        caught_by="`tests/callbacks/test_console_callbacks.py`",
        checked=CHECKED,
        check=lambda: resolve(
            "lightning.pytorch.callbacks.progress.rich_progress:RichProgressBar._get_train_description"
        ),
    )
)


def drop_unset_wandb_anonymous(logger) -> None:
    """Remove ``anonymous=None`` from a ``WandbLogger``'s arguments to ``wandb.init`` (its ``_wandb_init``) before
    the run starts: Lightning passes the key even when unset, and W&B warns that the setting has no effect. A set
    value is left alone. Checked on lightning 2.6.6 with wandb 0.31."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]


register(
    Private(
        name="WandbLogger._wandb_init",
        upstream="lightning",
        accessor="lightning.drop_unset_wandb_anonymous",
        used_by=("cli/app.py",),
        why="W&B's 'The anonymous setting has no effect' warning, caused by Lightning passing anonymous=None",
        caught_by="`tests/test_console.py` (the quick start's console)",
        checked=CHECKED,
        check=lambda: has_instance_attr("lightning.pytorch.loggers.wandb:WandbLogger", "_wandb_init"),
    )
)


def set_optimizer_steps(trainer, steps: int) -> None:
    """From inside an optimizer step: ``steps`` optimizer steps came before this one. Sets what
    ``trainer.global_step`` reads (the fit loop's optimizer-step progress, this step ready, not yet completed) and the
    loggers' step (``_batches_that_stepped``), as Lightning's own checkpoint restore does; no public setter. A replica
    group that recovered a live peer's state continues at the peer's step; a step the quorum did not commit is not
    counted. Checked on lightning 2.6.6."""
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    progress.completed, progress.ready = steps, steps + 1
    epoch_loop._batches_that_stepped = steps


register(
    Private(
        name="_TrainingEpochLoop._batches_that_stepped",
        upstream="lightning",
        accessor="lightning.set_optimizer_steps",
        used_by=("strategies/replica_groups.py",),
        why="a replica group that recovered a live peer's state continues at the peer's step (global_step and the "
        "loggers' step), as a restore from a checkpoint would",
        caught_by="`tests/strategies/test_fault_tolerance.py`",
        checked=CHECKED,
        check=lambda: has_instance_attr(
            "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop", "_batches_that_stepped"
        ),
    )
)

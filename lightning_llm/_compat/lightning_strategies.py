"""Private attributes and methods of the Lightning strategies our subclasses extend: ``Strategy``'s precision
plugin slot, ``ModelParallelStrategy``'s arguments, process-group setup and mesh, and ``DeepSpeedStrategy``'s
engine setup, which the CPU path of ``LLMDeepSpeedStrategy`` calls piece by piece."""

from __future__ import annotations

from lightning_llm._compat.registry import Private, has_instance_attr, register, resolve

CHECKED = "lightning 2.6.6"


def set_precision_plugin(strategy, plugin) -> None:
    """Store ``plugin`` where Lightning's ``Strategy.precision_plugin`` property reads it (``_precision_plugin``);
    for a subclass that overrides the setter. Checked on lightning 2.6.6."""
    strategy._precision_plugin = plugin


register(
    Private(
        name="Strategy._precision_plugin",
        upstream="lightning",
        accessor="lightning_strategies.set_precision_plugin",
        used_by=("strategies/parallel.py",),
        why="the parent's property keeps the plugin there; our setter stores the global-norm-clipping plugin in the "
        "same place",
        caught_by="`tests/strategies/test_parallel_parity.py` (clipping active)",
        checked=CHECKED,
        check=lambda: has_instance_attr("lightning.pytorch.strategies.strategy:Strategy", "_precision_plugin"),
    )
)


def setup_distributed(strategy) -> None:
    """``ModelParallelStrategy._setup_distributed()``: the parent's process-group setup (world ranks, environment,
    ``init_process_group``), reused by a ``setup_environment`` that builds its own mesh. Checked on lightning 2.6.6."""
    strategy._setup_distributed()


def set_device_mesh(strategy, mesh) -> None:
    """Set the mesh where ``ModelParallelStrategy`` keeps it (``strategy._device_mesh``) and where
    ``LightningModule.device_mesh`` reads it (``_device_mesh``, which has no public setter). Checked on lightning
    2.6.6."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


register(
    Private(
        name="ModelParallelStrategy._setup_distributed, _device_mesh; LightningModule._device_mesh",
        upstream="lightning",
        accessor="lightning_strategies.setup_distributed, set_device_mesh",
        used_by=("strategies/parallel.py",),
        why="the parent stores its mesh there and sets up the process group in `_setup_distributed`; our subclass "
        "builds its own 4-D mesh",
        caught_by="`tests/strategies/test_parallel_strategy.py`",
        checked=CHECKED,
        check=lambda: (
            has_instance_attr("lightning.pytorch.strategies.model_parallel:ModelParallelStrategy", "_device_mesh"),
            resolve("lightning.pytorch.strategies.model_parallel:ModelParallelStrategy._setup_distributed"),
            has_instance_attr("lightning.pytorch.core.module:LightningModule", "_device_mesh"),
        ),
    )
)


def init_deepspeed_distributed(strategy) -> None:
    """``DeepSpeedStrategy._init_deepspeed_distributed()``: DeepSpeed's ``init_distributed`` with Lightning's
    environment, the part of ``setup_distributed`` that does not require CUDA device indices. Checked on lightning
    2.6.6."""
    strategy._init_deepspeed_distributed()


def init_deepspeed_config(strategy) -> None:
    """``DeepSpeedStrategy._init_config_if_needed()``: format the DeepSpeed config (batch size, precision) once.
    Checked on lightning 2.6.6."""
    strategy._init_config_if_needed()


def reset_deepspeed_config(strategy) -> None:
    """Clear ``DeepSpeedStrategy._config_initialized`` so Lightning formats a replaced config again. Checked on
    lightning 2.6.6."""
    strategy._config_initialized = False


def deepspeed_setup_model_and_optimizer(strategy, model, optimizer, lr_scheduler=None):
    """Lightning's ``DeepSpeedStrategy._setup_model_and_optimizer`` for ``strategy`` (the next one in its MRO after
    the caller's class is Lightning's): the ``deepspeed.initialize`` call of ``setup``. Checked on lightning 2.6.6."""
    from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy._setup_model_and_optimizer(strategy, model, optimizer, lr_scheduler)


def deepspeed_initialize_inference(strategy, model) -> None:
    """Lightning's ``DeepSpeedStrategy._initialize_deepspeed_inference`` for ``strategy``. Checked on lightning
    2.6.6."""
    from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy

    DeepSpeedStrategy._initialize_deepspeed_inference(strategy, model)


register(
    Private(
        name="DeepSpeedStrategy._setup_model_and_optimizer, _initialize_deepspeed_inference, "
        "_init_deepspeed_distributed, _init_config_if_needed, _config_initialized",
        upstream="lightning",
        accessor="lightning_strategies.deepspeed_setup_model_and_optimizer, deepspeed_initialize_inference, "
        "init_deepspeed_distributed, init_deepspeed_config, reset_deepspeed_config",
        used_by=("strategies/deepspeed.py",),
        why="the CPU path only (CUDA goes straight to the parent): Lightning passes `root_device.index` (None on CPU) "
        "as DeepSpeed's device rank and refuses non-CUDA accelerators; our subclass overrides the two hooks and "
        "copies one `deepspeed.initialize` call per method",
        caught_by="`tests/strategies/test_deepspeed.py` (parity, resume, inference on CPU), "
        "`tests/strategies/test_deepspeed_init.py`",
        checked=CHECKED,
        check=lambda: (
            resolve("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._setup_model_and_optimizer"),
            resolve("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._initialize_deepspeed_inference"),
            resolve("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._init_deepspeed_distributed"),
            resolve("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy._init_config_if_needed"),
            has_instance_attr("lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy", "_config_initialized"),
        ),
    )
)

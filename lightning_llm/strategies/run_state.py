"""What one run of an LLMParallelStrategy decides and builds: filled by ``setup_environment`` and ``setup``.

The strategy's options (:mod:`.parallel_options`) are fixed at construction; everything here changes during a
run: the ZeRO stage and offload "auto" resolves to, the mesh, what parallelization did, the pipeline runtime.
The contract members (:mod:`.parallel_contract`) and the setup steps (:mod:`.parallel_setup`) are functions of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_llm._compat.known_warnings import ScopedFilters
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.parallelize import ParallelizeReport
from lightning_llm.parallel.pipeline.stage_plan import PipelineSpec
from lightning_llm.strategies.parallel_options import StrategyOptions
from lightning_llm.strategies.pipelined_steps import PipelinedSteps


@dataclass
class RunState:
    """The run's resolved ZeRO stage, mesh, parallelization report, pipeline runtime, AC policies and model shape."""

    zero_stage: Any  # 0-3, or "auto" until setup plans it
    cpu_offload: bool
    pipeline: PipelineSpec  # the options' spec; setup fills its seq_len
    decision: Any = None  # the planner's ZeroDecision once zero_stage="auto" is resolved
    layout: Any = None  # layout="auto": the chosen Candidate (strategies.layout_auto), from setup on
    parallel_dims: ParallelDims | None = None  # from setup_environment on
    report: ParallelizeReport | None = None  # from setup on
    pipelined: PipelinedSteps | None = None  # with pipeline parallelism, from setup on
    ac_policies: list[str] = field(default_factory=list)  # "none" / "full" / "op" per block
    model_shape: ModelShape | None = None  # read before the model is sharded and cut into stages
    agreed_seed: int | None = None  # rank 0's seed, when setup found the ranks' generators differing
    meta_writes: Any = None  # values configure_model copied into meta tensors (parallel.init.meta_writes)
    batch_line_pending: bool = False  # the global batch is logged from the first batch (a plain DataLoader)
    warning_filters: ScopedFilters = field(default_factory=ScopedFilters)  # from setup_environment to teardown
    replica_env: Any = None  # with fault_tolerance: the ReplicaGroupEnvironment, from setup_environment on
    replica_groups: Any = None  # with fault_tolerance: the ReplicaGroups (torchft's manager), from setup to teardown
    accumulating: bool = False  # inside Lightning's block_backward_sync (an accumulation micro-batch)

    @classmethod
    def before_setup(cls, options: StrategyOptions) -> RunState:
        return cls(
            zero_stage=options.parallel.zero_stage,
            cpu_offload=options.parallel.cpu_offload,
            pipeline=options.pipeline.spec(),
        )

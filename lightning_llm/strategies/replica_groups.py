"""Fault-tolerant replica groups: torchft's quorum, gradient average and live-peer recovery inside Lightning's loop.

With ``LLMParallelStrategy(fault_tolerance=True)`` the job is several *replica groups*, each its own launch (torchrun
or Lightning's launcher on its own machines) of the same script with the same layout inside (ZeRO, TP, PP, CP, EP). A
torchft lighthouse forms a quorum of the groups present at every optimizer step; gradients, already reduced inside
each group, are averaged over the groups of the quorum; a group that dies mid-step fails that step's cross-group
average on the others, who skip the update and go on without it from the next quorum. A group that starts (or
restarts) while others train joins the next quorum and receives the weights, optimizer state, schedulers and step
count from a live peer (torchft's checkpoint transport: each rank from the same rank of a live group), not from disk.

torchft owns the protocol (its ``Manager``); this module only connects it to Lightning's step: the quorum
starts with the first micro-batch of a step, the cross-group average runs after the last backward, the optimizer
steps only when the quorum commits, and a recovered group's ``global_step`` is the peer's.

Each group's launch carries torchft's environment: ``TORCHFT_LIGHTHOUSE`` (the lighthouse's address),
``REPLICA_GROUP_ID`` (0, 1, ...) and ``NUM_REPLICA_GROUPS`` (for the data: group ``g`` reads shard ``g`` of
``NUM_REPLICA_GROUPS``, split again inside the group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor

ENVIRONMENT = ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS")


@dataclass(frozen=True)
class ReplicaGroupEnvironment:
    """Where this launch sits among the replica groups, from torchft's environment variables.

    Example::

        env = ReplicaGroupEnvironment.from_environ()  # TORCHFT_LIGHTHOUSE=http://host:29510 REPLICA_GROUP_ID=1 ...
        env.group_id, env.num_groups  # (1, 2)
    """

    lighthouse: str
    group_id: int
    num_groups: int

    @classmethod
    def from_environ(cls) -> ReplicaGroupEnvironment:
        missing = [name for name in ENVIRONMENT if not os.environ.get(name)]
        if missing:
            raise RuntimeError(
                f"fault_tolerance=True needs torchft's environment in every replica group's launch; {missing} "
                "unset. Start a lighthouse (`torchft_lighthouse --min_replicas 1 --bind [::]:29510`) and launch each "
                "group with TORCHFT_LIGHTHOUSE=http://HOST:29510 REPLICA_GROUP_ID=0, 1, ... NUM_REPLICA_GROUPS=N "
                "(docs/fault-tolerance.md)."
            )
        group_id, num_groups = _int_env("REPLICA_GROUP_ID"), _int_env("NUM_REPLICA_GROUPS")
        if not 0 <= group_id < num_groups:
            raise RuntimeError(
                f"REPLICA_GROUP_ID={group_id} is not in [0, NUM_REPLICA_GROUPS={num_groups}); number the groups "
                "0 to NUM_REPLICA_GROUPS - 1."
            )
        return cls(os.environ["TORCHFT_LIGHTHOUSE"], group_id, num_groups)

    def sampler_kwargs(self, dp: int, dp_rank: int) -> dict[str, int]:
        """``DistributedSampler`` arguments: this group's shard of the data, split over its data-parallel ranks."""
        return {"num_replicas": self.num_groups * dp, "rank": self.group_id * dp + dp_rank}


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} is not an integer.") from None


class ReplicaGroups:
    """One launch's membership in the replica groups: a torchft ``Manager`` and the hooks Lightning's step calls.

    Built by the strategy at setup, once the model is parallelized and the optimizers exist. ``rank`` and
    ``world_size`` are the launch's own (the ranks inside this group).

    Example (what :class:`~lightning_llm.strategies.LLMParallelStrategy` does with ``fault_tolerance=True``)::

        groups = ReplicaGroups(ReplicaGroupEnvironment.from_environ(), trainer, rank=0, world_size=1, timeout=timeout)
        groups.start_step()  # first micro-batch of a step
        loss = closure()  # forward and backward
        groups.average_gradients()
        if groups.should_commit():
            optimizer.step()
    """

    def __init__(
        self,
        env: ReplicaGroupEnvironment,
        trainer,
        *,
        rank: int,
        world_size: int,
        timeout: timedelta,
        sync: bool | str = "ddp",
        sync_every: int = 100,
    ):
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.env, self.trainer = env, trainer
        self.module = trainer.lightning_module
        self.every_step = sync in (True, "ddp")  # else every sync_every steps, by torchft's optimizer hooks
        cuda = self.module.device.type == "cuda"
        self.manager = Manager(
            pg=ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=1,
            timeout=timeout,
            quorum_timeout=timeout,
            rank=rank,
            world_size=world_size,
            lighthouse_addr=env.lighthouse,
            replica_id=f"group_{env.group_id}",
            # Groups that start together must start from the same weights (checked at their first step, below);
            # torchft's init_sync would instead have all but one group heal at step 1 and leave their gradients out.
            init_sync=False,
            use_async_quorum=self.every_step,  # DiLoCo needs the quorum (and a joiner's recovery) before its sync
        )
        self.skipped_steps = 0  # steps whose quorum did not commit (a group lost mid-step)
        self.events: list[str] = []  # groups leaving and joining, as said to the log
        self._present: int | None = None  # groups of the last step
        self._recovering = False  # this launch loaded a live group's state in the current step
        # The model's tensors as the optimizer updates them (FSDP2's sharded parameters), taken here on the main
        # thread: torchft reads the state for a recovering peer from its quorum thread while this rank runs a
        # forward, and a state_dict() call there would re-register FSDP2's sharded parameters mid-forward.
        self.tensors = dict(self.module.state_dict(keep_vars=True))
        self.periodic = None if self.every_step else _periodic_sync(self.manager, trainer, sync, sync_every)

    def start_step(self) -> None:
        """The first micro-batch of a step: ask the lighthouse for this step's quorum (it forms during the forward)."""
        self.manager.start_quorum()

    def average_gradients(self) -> None:
        """Average every gradient over the groups of the quorum, each rank its own shard (its group reduced them)."""
        self.manager.wait_quorum()
        if self.manager.current_step() == 0 and self.manager.is_participating():
            self._check_same_start()  # every group of this quorum is at its first step
        works = [self.manager.allreduce(_local(p.grad)) for p in self.module.parameters() if p.grad is not None]
        for work in works:
            work.wait()

    def should_commit(self) -> bool:
        """Whether every group of the quorum finished the step (a recovering group loads its peer's state here).

        A step that does not commit updates nothing and is not counted: ``global_step`` counts committed updates.
        """
        committed = self.manager.should_commit()
        if not committed:
            self.skipped_steps += 1
            _set_global_step(self.trainer, self.trainer.global_step - 1)
        self._report_membership()
        return committed

    def _report_membership(self) -> None:
        """Say when groups leave or join the job, and what their data shards miss meanwhile (``self.events`` too)."""
        present, total, step = self.participants, self.env.num_groups, self.trainer.global_step + 1
        if self._recovering:
            event = (
                f"Replica group {self.env.group_id} recovered step {step - 1} from a live group and trains from step "
                f"{step}; its data (shard {self.env.group_id} of {total}) restarts from its first batch."
            )
        elif present != self._present and (
            self._present is not None or present < total
        ):  # a group missing at start too
            missing = total - present
            event = f"Step {step}: {present} of {total} replica groups train" + (
                f"; the data shards of the {missing} missing are not trained until they return." if missing else "."
            )
        else:
            event = None
        self._present, self._recovering = present, False
        if event is not None:
            self.events.append(event)
            rank_zero_info(event)

    def _check_same_start(self) -> None:
        """Refuse groups that start together from different weights (a seed that differs between launches)."""
        import torch.distributed as dist

        local = [_local(t).detach().double() for t in self.tensors.values()]
        fingerprint = torch.stack([sum(t.sum() for t in local), sum((t * t).sum() for t in local)])
        highest, lowest = fingerprint.clone(), -fingerprint
        works = [self.manager.allreduce(t, reduce_op=dist.ReduceOp.MAX) for t in (highest, lowest)]
        for work in works:
            work.wait()
        if self.manager.errored() is None and not torch.equal(highest, -lowest):
            raise RuntimeError(
                f"Replica group {self.env.group_id} starts from other weights than a group it trains with: seed every "
                "group's launch the same (L.seed_everything(SEED) before building the model), or load the same "
                "checkpoint in each; with different weights the groups would never agree."
            )

    def metrics(self) -> dict[str, float]:
        """What the loggers get at every step (W&B: quorum changes show as steps in ``fault_tolerance/groups``)."""
        return {
            "fault_tolerance/groups": float(self.participants),
            "fault_tolerance/skipped_steps": float(self.skipped_steps),
        }

    @property
    def participants(self) -> int:
        """How many groups averaged the last step's gradients."""
        return self.manager.num_participants()

    def shutdown(self) -> None:
        if self.periodic is not None:
            self.periodic.__exit__(None, None, None)  # its optimizer hooks go
        self.manager.shutdown(wait=False)

    def _state_dict(self) -> dict[str, Any]:
        """What a recovering group receives from this rank: local shards only (the same rank of any group holds the
        same shard), the optimizers, the schedulers and the step."""
        trainer = self.trainer
        return {
            "model": {name: _local(t).detach() for name, t in self.tensors.items()},
            "optimizers": [_local_state(o.state_dict()) for o in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step,
        }

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        for name, tensor in self.tensors.items():
            _local(tensor).copy_(state["model"][name])
        for optimizer, received in zip(trainer.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(_distributed_state(received, optimizer))
        for config, received in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(received)
        _set_global_step(trainer, state["global_step"])
        self._recovering = True


def _periodic_sync(manager, trainer, sync: str, sync_every: int):
    """torchft's LocalSGD or DiLoCo on the run's optimizer, entered: they synchronize from its step hooks.

    DiLoCo's outer optimizer is the paper's: Nesterov SGD, learning rate 0.7, momentum 0.9.
    """
    from torchft.local_sgd import DiLoCo, LocalSGD

    if len(trainer.optimizers) != 1:
        raise ValueError(
            f'fault_tolerance="{sync}" synchronizes one optimizer; configure_optimizers returned '
            f"{len(trainer.optimizers)}. Use one optimizer, or fault_tolerance=True."
        )
    module, (optimizer,) = trainer.lightning_module, trainer.optimizers
    if sync == "local_sgd":
        return LocalSGD(manager, module, optimizer, sync_every).__enter__()
    outer = torch.optim.SGD(module.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    pin = torch.cuda.is_available()
    return DiLoCo(manager, [module], optimizer, outer, sync_every, pin_memory=pin).__enter__()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict with its DTensors replaced by their local shards (a mesh does not travel)."""
    per_param = {
        index: {key: _local(value) if isinstance(value, torch.Tensor) else value for key, value in entries.items()}
        for index, entries in state["state"].items()
    }
    return {"state": per_param, "param_groups": state["param_groups"]}


def _distributed_state(state: dict[str, Any], optimizer) -> dict[str, Any]:
    """The inverse of :func:`_local_state` on this rank: a shard shaped like its parameter's becomes a DTensor again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {}
    for index, entries in state["state"].items():
        param = params[index]
        per_param[index] = {
            key: _like(value, param) if isinstance(value, torch.Tensor) else value for key, value in entries.items()
        }
    return {"state": per_param, "param_groups": state["param_groups"]}


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor) and value.shape == param.to_local().shape and value.dim() > 0:
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value


def _set_global_step(trainer, step: int) -> None:
    """Inside a step: ``step`` optimizer steps came before it (what ``trainer.global_step`` reads)."""
    from lightning_llm._compat.lightning import set_optimizer_steps

    set_optimizer_steps(trainer, step)

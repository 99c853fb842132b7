"""Fault-tolerant replica groups (``LLMParallelStrategy(fault_tolerance=True)``, torchft) on CPU with gloo.

Each replica group is its own ``run_distributed`` launch, run from a thread of the test, with a torchft lighthouse in
the test process. The oracle of the parity test is a plain data-parallel run over as many ranks as the groups hold
in all; the drill's oracle is the live group: the relaunched group must end with its exact parameters.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_llm.callbacks import CheckpointRotation, MFUMonitor
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.strategies.replica_groups import ENVIRONMENT, ReplicaGroupEnvironment
from lightning_llm.testing import DistributedTestError, cpu_trainer, run_distributed

pytest.importorskip("torchft", reason="fault tolerance needs the ft extra (torchft)")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

STEPS = 12
DRILL_STEPS, KILL_AT = 30, 5


def _lighthouse(min_replicas: int):
    from torchft.coordination import LighthouseServer

    # A quorum forms once every heartbeating group joined, or join_timeout after the first; a group silent for
    # heartbeat_timeout is dead.
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000, heartbeat_timeout_ms=1000)


class _Record(L.Callback):
    """Each step's loss and global step; rank 0 of a group writes its progress to ``progress`` (the test polls it);
    optionally the process kills itself (SIGKILL, as a lost machine) when ``kill_at`` is reached, or slows down."""

    def __init__(self, progress: str | None, kill_at: int | None, step_delay: float):
        self.losses, self.steps, self.participants, self.initial, self.events = [], [], [], None, []
        self.progress, self.kill_at, self.step_delay = progress, kill_at, step_delay

    def on_train_start(self, trainer, pl_module):
        self.initial = {n: _full(p) for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.steps.append(trainer.global_step)
        groups = trainer.strategy.run_state.replica_groups
        self.participants.append(groups.participants if groups is not None else None)
        self.events = list(groups.events) if groups is not None else []
        if self.progress and trainer.global_rank == 0:
            Path(self.progress).write_text(str(trainer.global_step))
        if self.kill_at is not None and trainer.global_step >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.step_delay)


def _fit(
    zero_stage: int,
    fault_tolerance: bool,
    progress=None,
    kill_at=None,
    step_delay=0.0,
    steps=STEPS,
    replicate=1,
    seed=0,
    sync_every=100,
    strategy_class=LLMParallelStrategy,
    accumulate=1,
    schedule_steps=None,
    rotation_dir=None,
    tp=1,
    pp=1,
) -> dict:
    L.seed_everything(seed)
    record = _Record(progress, kill_at, step_delay)
    rotation = [CheckpointRotation(dirpath=rotation_dir, every_n_train_steps=4)] if rotation_dir else []
    world = int(os.environ["WORLD_SIZE"])
    trainer = cpu_trainer(
        devices=world,
        strategy=strategy_class(
            zero_stage=zero_stage,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_replicate_size=replicate if zero_stage else 1,
            fault_tolerance=fault_tolerance,
            fault_tolerance_sync_every=sync_every,
            timeout=20,
        ),
        max_steps=steps,
        callbacks=[record, MFUMonitor(peak_flops=1e12, log_every_n_steps=1), *rotation],
        log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=bool(rotation),
    )
    module = CausalLM("tiny", warmup_steps=2, max_steps=schedule_steps or steps)
    data = LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=2, shuffle=False)
    trainer.fit(module, data, ckpt_path="last" if rotation_dir else None)
    params = {n: _full(p) for n, p in module.named_parameters()}
    return {
        "losses": record.losses,
        "steps": record.steps,
        "participants": record.participants,
        "params": params,
        "initial": record.initial,
        "events": record.events,
        "logged": {k: float(v) for k, v in trainer.logged_metrics.items()},
    }


def _group(group_id: int, num_groups: int, lighthouse: str, zero_stage: int, sync=True, **options) -> dict:
    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group_id), NUM_REPLICA_GROUPS=str(num_groups))
    return _fit(zero_stage, sync, **options)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _hsdp(zero_stage: int, groups: int, accumulate: int, tp: int, pp: int) -> dict:
    """The oracle: one launch over every rank, the groups as the replicate axis (HSDP; plain DDP at ZeRO 0)."""
    return _fit(zero_stage, False, replicate=groups, accumulate=accumulate, tp=tp, pp=pp)


def _wait_for_step(progress: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= step):
        assert time.monotonic() < deadline, f"{progress} never reached step {step}"
        time.sleep(0.1)


def _run_groups(launches: list[tuple], results: dict) -> list[threading.Thread]:
    """Start each ``(key, group_size, args...)`` launch in a thread; its ranks' results (or error) land in ``results``."""

    def launch(key, size, *args, **kwargs):
        try:
            results[key] = run_distributed(_group, size, *args, timeout=360, native_crash_retries=0, **kwargs)
        except DistributedTestError as err:
            results[key] = err

    threads = [threading.Thread(target=launch, args=spec[:-1], kwargs=spec[-1]) for spec in launches]
    for thread in threads:
        thread.start()
    return threads


def _assert_same_params(got: dict, want: dict, atol: float, what: str) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize(
    ("group_size", "zero_stage", "accumulate", "tp", "pp"),
    [(1, 0, 2, 1, 1), (2, 3, 1, 1, 1), (2, 0, 1, 2, 1), (2, 1, 1, 1, 2)],
    ids=["2x1-zero0-accumulate2", "2x2-zero3", "2x2-tp2", "2x2-pp2-zero1"],
)
def test_two_replica_groups_train_as_one_data_parallel_run(group_size, zero_stage, accumulate, tp, pp):
    lighthouse = _lighthouse(min_replicas=2)  # both groups in every quorum
    try:
        results = {}
        options = {"accumulate": accumulate, "tp": tp, "pp": pp}
        threads = _run_groups(
            [(g, group_size, g, 2, lighthouse.address(), zero_stage, options) for g in range(2)], results
        )
        for thread in threads:
            thread.join()
    finally:
        lighthouse.shutdown()
    for key in (0, 1):
        assert not isinstance(results[key], Exception), results[key]
    want = run_distributed(_hsdp, 2 * group_size, zero_stage, 2, accumulate, tp, pp, timeout=240)
    # Group g's rank r is the plain run's rank of data-parallel index g at the same place inside the group.
    for g in (0, 1):
        for r in range(group_size):
            # the plain run's mesh puts pp outermost, dp next, tp innermost
            got, ref = results[g][r], want[r * 2 + g if pp > 1 else g * group_size + r]
            assert got["steps"] == ref["steps"] and got["steps"][-1] == STEPS
            logged = got["logged"]
            assert logged["fault_tolerance/groups"] == 2.0 and logged["fault_tolerance/skipped_steps"] == 0.0
            # Throughput counted over the job: both groups' devices, as the plain run counts all of its ranks.
            for run in (logged, ref["logged"]):
                ratio = run["train/flops_per_sec"] / run["train/device/flops_per_sec"]
                assert ratio == pytest.approx(2 * group_size), run
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=1e-5)
            _assert_same_params(got["params"], ref["params"], 1e-5, f"group {g} rank {r}")


DRILLS = {
    # group killed, the steps at which each of its launches dies (the last launch trains to the end), step delay
    "2x2-zero3": (2, 3, 1, [KILL_AT], 0.5),
    "2x1-group0-twice": (1, 0, 0, [4, 11], 0.7),  # the first group, killed again after it recovered
}


@pytest.mark.parametrize("drill", DRILLS)
def test_a_killed_group_is_dropped_the_other_keeps_stepping_and_the_relaunch_recovers_from_it(tmp_path, drill):
    """SIGKILL a group at the given steps of 30; the other goes on alone; each relaunch recovers from it."""
    group_size, zero_stage, victim, kills, delay = DRILLS[drill]
    live = 1 - victim
    lighthouse = _lighthouse(min_replicas=1)  # a quorum of one group is enough: the survivor goes on
    progress = {g: tmp_path / f"group{g}.step" for g in (0, 1)}
    common = (2, lighthouse.address(), zero_stage)
    results, threads = {}, []
    try:
        options = {"progress": str(progress[live]), "step_delay": delay, "steps": DRILL_STEPS}
        threads += _run_groups([("survivor", group_size, live, *common, options)], results)
        for launch, kill_at in enumerate([*kills, None]):
            options = {"progress": str(progress[victim]), "kill_at": kill_at, "steps": DRILL_STEPS}
            threads += _run_groups([(launch, group_size, victim, *common, options)], results)
            if kill_at is not None:
                threads[-1].join()  # the victim died at step kill_at
                _wait_for_step(progress[live], kill_at + 3)  # the survivor stepped on without it
        for thread in threads:
            thread.join()
    finally:
        lighthouse.shutdown()
    for launch in range(len(kills)):
        assert isinstance(results[launch], DistributedTestError) and "-9" in str(results[launch]), results[launch]
    assert not isinstance(results["survivor"], Exception), str(results["survivor"])
    assert not isinstance(results[len(kills)], Exception), str(results[len(kills)])
    survivor, relaunched = results["survivor"][0], results[len(kills)][0]
    for rank in range(group_size):  # every rank of a group saw the same steps and ended with the same weights
        assert results["survivor"][rank]["steps"] == survivor["steps"]
        _assert_same_params(results[len(kills)][rank]["params"], survivor["params"], 0.0, f"relaunched rank {rank}")
    # The survivor never restarted: its steps rise to the end; at most the step in flight at each death was lost.
    steps = survivor["steps"]
    assert steps == sorted(steps) and steps[-1] == DRILL_STEPS and len(steps) - DRILL_STEPS <= len(kills), steps
    alone = [p for p in survivor["participants"][kills[0] :] if p == 1]
    assert alone and survivor["participants"][-1] == 2, survivor["participants"]
    assert survivor["logged"]["fault_tolerance/groups"] == 2.0  # what W&B shows: both groups again at the end
    assert survivor["logged"]["fault_tolerance/skipped_steps"] == len(steps) - DRILL_STEPS
    # The last relaunch started at the survivor's step (recovered, not from step 0) and ended with it, identical.
    assert relaunched["steps"][0] > kills[-1] + 3 and relaunched["steps"][-1] == DRILL_STEPS, relaunched["steps"]
    _assert_same_params(relaunched["params"], survivor["params"], 0.0, "relaunched group vs survivor")
    # What the log says: each departure and return (with the shards not trained meanwhile), and each recovery.
    left = [e for e in survivor["events"] if "1 of 2 replica groups train; the data shards of the 1 missing" in e]
    back = [e for e in survivor["events"] if "2 of 2 replica groups train." in e]
    # (>=: a group that starts a second late joins at the survivor's second step, a return too)
    assert len(left) >= len(kills) and len(back) >= len(kills) and survivor["events"][-1] == back[-1], survivor[
        "events"
    ]
    first = relaunched["steps"][0]
    assert relaunched["events"][0] == (
        f"Replica group {victim} recovered step {first - 1} from a live group and trains from step {first}; its data "
        f"(shard {victim} of 2) restarts from its first batch."
    ), relaunched["events"]
    print(
        f"{drill}: survivor steps {steps}, groups per step {survivor['participants']}; "
        f"last relaunch steps {relaunched['steps']}"
    )


def test_groups_that_start_from_different_weights_are_refused_at_the_first_step():
    lighthouse = _lighthouse(min_replicas=2)
    try:
        results = {}
        launches = [(g, 1, g, 2, lighthouse.address(), 0, {"seed": g}) for g in range(2)]  # seeds 0 and 1
        for thread in _run_groups(launches, results):
            thread.join()
    finally:
        lighthouse.shutdown()
    for g in (0, 1):
        assert isinstance(results[g], DistributedTestError)
        assert f"Replica group {g} starts from other weights" in str(results[g]), str(results[g])


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"data_parallel_replicate_size": 2}, "keep data_parallel_replicate_size=1 inside a group"),
    ],
)
def test_layouts_the_cross_group_average_is_not_built_for_are_refused_at_construction(arguments, match):
    with pytest.raises(ValueError, match=match):
        LLMParallelStrategy(fault_tolerance=True, **arguments)


def test_a_launch_without_torchfts_environment_is_refused_naming_the_variables(monkeypatch):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    with pytest.raises(RuntimeError, match=r"\['TORCHFT_LIGHTHOUSE', 'NUM_REPLICA_GROUPS'\] unset"):
        ReplicaGroupEnvironment.from_environ()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    with pytest.raises(RuntimeError, match=r"REPLICA_GROUP_ID=2 is not in \[0, NUM_REPLICA_GROUPS=2\)"):
        ReplicaGroupEnvironment.from_environ()


def test_each_group_reads_its_own_shard_split_over_its_ranks():
    env = ReplicaGroupEnvironment("http://localhost:29510", group_id=1, num_groups=3)
    # 3 groups x 2 data-parallel ranks: 6 shards, group 1 holds shards 2 and 3.
    assert [env.sampler_kwargs(dp=2, dp_rank=r) for r in (0, 1)] == [
        {"num_replicas": 6, "rank": 2},
        {"num_replicas": 6, "rank": 3},
    ]


class _OneShard(LLMParallelStrategy):
    """A plain single-process run that reads shard ``SHARD`` of 2, as replica group ``SHARD`` of 2 does."""

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": 2, "rank": int(os.environ["SHARD"])}


def _one_shard(shard: int, steps: int) -> dict:
    os.environ["SHARD"] = str(shard)
    return _fit(0, False, steps=steps, strategy_class=_OneShard)


SYNC_EVERY = 4


@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
def test_periodic_sync_after_one_round_matches_the_groups_trained_alone_then_combined_by_hand(sync):
    """Oracle: each group's 4 steps as a plain single-process run on its shard, combined with torch's own ops:
    LocalSGD averages the parameters; DiLoCo steps torch's Nesterov SGD (lr 0.7, momentum 0.9) from the start on the
    averaged pseudo-gradient (start - local)."""
    lighthouse = _lighthouse(min_replicas=2)
    try:
        results = {}
        options = {"sync": sync, "sync_every": SYNC_EVERY, "steps": SYNC_EVERY}
        for thread in _run_groups([(g, 1, g, 2, lighthouse.address(), 0, options) for g in range(2)], results):
            thread.join()
    finally:
        lighthouse.shutdown()
    alone = [run_distributed(_one_shard, 1, g, SYNC_EVERY, timeout=120)[0] for g in range(2)]
    start = alone[0]["initial"]
    assert all(torch.equal(alone[1]["initial"][n], t) for n, t in start.items())
    want = {}
    for name, initial in start.items():
        local = (alone[0]["params"][name] + alone[1]["params"][name]) / 2
        if sync == "local_sgd":
            want[name] = local
        else:
            param = torch.nn.Parameter(initial.clone())
            param.grad = initial - local
            torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True).step()
            want[name] = param.detach()
    for g in range(2):
        (got,) = results[g]
        assert got["steps"] == list(range(1, SYNC_EVERY + 1))
        torch.testing.assert_close(got["losses"], alone[g]["losses"], rtol=0, atol=1e-6)  # local steps: its own
        _assert_same_params(got["params"], want, 1e-5, f"{sync} group {g}")


def test_a_sync_interval_the_mode_ignores_is_said():
    with pytest.warns(UserWarning, match="fault_tolerance_sync_every=10 ignored: fault_tolerance=True"):
        LLMParallelStrategy(fault_tolerance=True, fault_tolerance_sync_every=10)


def _two_groups(**options) -> dict:
    """Both groups (one rank each) to the end, in a quorum of both; ``{group: its rank's result}``."""
    lighthouse = _lighthouse(min_replicas=2)
    results = {}
    try:
        launches = []
        for g in range(2):
            per_group = {k: (v.format(group=g) if isinstance(v, str) else v) for k, v in options.items()}
            launches.append((g, 1, g, 2, lighthouse.address(), 0, per_group))
        for thread in _run_groups(launches, results):
            thread.join()
    finally:
        lighthouse.shutdown()
    for g in range(2):
        assert not isinstance(results[g], Exception), str(results[g])
    return {g: results[g][0] for g in range(2)}


def test_the_whole_job_restarted_from_its_checkpoints_continues_as_if_never_stopped(tmp_path):
    """Both groups save with CheckpointRotation every 4 steps and stop at step 4; relaunched with ckpt_path="last",
    they end at step 8 with the parameters of a straight 8-step run of both groups (1e-6, fp32)."""
    straight = _two_groups(steps=8)
    stopped = _two_groups(steps=4, schedule_steps=8, rotation_dir=str(tmp_path / "group{group}"))
    resumed = _two_groups(steps=8, rotation_dir=str(tmp_path / "group{group}"))
    for g in range(2):
        assert stopped[g]["steps"] == [1, 2, 3, 4] and resumed[g]["steps"] == [5, 6, 7, 8]
        torch.testing.assert_close(resumed[g]["losses"], straight[g]["losses"][4:], rtol=0, atol=1e-6)
        _assert_same_params(resumed[g]["params"], straight[g]["params"], 1e-6, f"resumed group {g}")

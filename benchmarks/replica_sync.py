"""Loss curves of two fault-tolerant replica groups: synchronized every step, LocalSGD and DiLoCo.

A torchft lighthouse in this process and two replica groups (one CPU rank each, the tiny reference Llama on the
synthetic corpus, each group on its own half of the data) train ``--steps`` steps three times:
``fault_tolerance=True`` (gradients averaged every step, the synchronous equivalent of one data-parallel run),
``"local_sgd"`` and ``"diloco"`` (synchronized every ``--sync_every`` steps). Prints a Markdown table of the loss
(the mean of the two groups' losses, over the ``--every`` steps up to each row) and how many times the groups
communicated.

    OMP_NUM_THREADS=1 python benchmarks/replica_sync.py --steps 200 --sync_every 20
"""

from __future__ import annotations

import argparse
import os
import threading

import lightning as L

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed

MODES = {"every step": True, "LocalSGD": "local_sgd", "DiLoCo": "diloco"}


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _group(group: int, lighthouse: str, sync, steps: int, sync_every: int) -> list[float]:
    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2")
    L.seed_everything(0)
    losses = _Losses()
    strategy = LLMParallelStrategy(zero_stage=0, fault_tolerance=sync, fault_tolerance_sync_every=sync_every)
    trainer = cpu_trainer(devices=1, strategy=strategy, max_steps=steps, callbacks=[losses])
    module = CausalLM("tiny", learning_rate=3e-3, warmup_steps=steps // 10, max_steps=steps)
    trainer.fit(module, LLMDataModule(source="synthetic", seq_len=64, batch_size=8))
    return losses.losses


def curves(steps: int, sync_every: int) -> dict[str, list[float]]:
    """Each mode's per-step loss, the mean of the two groups'."""
    from torchft.coordination import LighthouseServer

    out = {}
    for label, sync in MODES.items():
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
        results: dict[int, list[float]] = {}

        def launch(group: int, address: str = lighthouse.address(), mode=sync) -> None:
            results[group] = run_distributed(_group, 1, group, address, mode, steps, sync_every, timeout=1800)[0]

        threads = [threading.Thread(target=launch, args=(g,)) for g in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        lighthouse.shutdown()
        out[label] = [(a + b) / 2 for a, b in zip(results[0], results[1], strict=True)]
    return out


def table(losses: dict[str, list[float]], every: int, sync_every: int) -> str:
    steps = len(next(iter(losses.values())))
    syncs = {"every step": steps, "LocalSGD": steps // sync_every, "DiLoCo": steps // sync_every}
    rows = [
        "| steps | " + " | ".join(losses) + " |",
        "| --- |" + " --- |" * len(losses),
    ]
    for end in range(every, steps + 1, every):
        means = [sum(curve[end - every : end]) / every for curve in losses.values()]
        rows.append(f"| {end - every + 1}-{end} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    rows.append("| syncs between groups | " + " | ".join(str(syncs[label]) for label in losses) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync_every", type=int, default=20)
    parser.add_argument("--every", type=int, default=20, help="steps per row of the table")
    args = parser.parse_args()
    print(table(curves(args.steps, args.sync_every), args.every, args.sync_every))


if __name__ == "__main__":
    main()

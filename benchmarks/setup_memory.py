"""Peak host memory of each rank while LLMParallelStrategy (ZeRO 3) builds, shards and initializes a model.

``--strategy deepspeed`` measures LLMDeepSpeedStrategy(zero_stage=3) instead: the model is built on the meta device,
each rank allocates only its ZeRO-3 partitions and the model's own init fills them (random fills drawn in chunks,
other ops on a few gathered parameters at a time); the "built" column is the peak before DeepSpeed's engine
allocates its own fp32 partitions and buffers.

The model is created in ``configure_model``: on the meta device, then each rank allocates its shard
and initializes it (lightning_llm.parallel.init.materialize). ``--eager`` builds the whole model on every
rank first (the behaviour before meta construction), for comparison.

    python benchmarks/setup_memory.py --ranks 4 --preset 1B
"""

from __future__ import annotations

import argparse

from lightning_llm.models import LlamaConfig
from lightning_llm.testing import run_distributed
from lightning_llm.testing.setup_memory import measure_setup_memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--preset", default="1B")
    parser.add_argument("--layers", type=int, help="override the preset's number of layers")
    parser.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    parser.add_argument("--eager", action="store_true", help="build the whole model on every rank (no meta device)")
    parser.add_argument("--strategy", choices=["parallel", "deepspeed"], default="parallel")
    args = parser.parse_args()
    overrides = {"n_layers": args.layers} if args.layers else {}
    overrides.update({"vocab_size": args.vocab} if args.vocab else {})
    config = LlamaConfig.from_name(args.preset, **overrides)
    rows = run_distributed(
        measure_setup_memory, args.ranks, config, 3, False if args.eager else None, args.strategy, timeout=3600
    )
    mib = 2**20
    construction = "eager" if args.eager else "meta"
    print(
        f"preset={args.preset} layers={config.n_layers} vocab={config.vocab_size} ranks={args.ranks} ZeRO 3 fp32 ({args.strategy}), "
        f"{construction} construction; MiB"
    )
    print(
        f"{'rank':>4} {'peak RSS increase':>18} {'built':>8} {'own shard':>10} {'shard + 25% block':>18} "
        f"{'whole model':>12}"
    )
    for rank, row in enumerate(rows):
        bound = row["shard"] + row["block"] / 4
        built = f"{row['built'] / mib:.0f}" if "built" in row else "-"
        print(
            f"{rank:>4} {row['peak'] / mib:>18.0f} {built:>8} {row['shard'] / mib:>10.0f} {bound / mib:>18.0f} "
            f"{row['model'] / mib:>12.0f}"
        )


if __name__ == "__main__":
    main()

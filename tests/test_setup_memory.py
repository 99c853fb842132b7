"""Host memory while LLMParallelStrategy or LLMDeepSpeedStrategy (ZeRO 3) builds a model: each rank's shard, not the whole model; ``plan`` builds nothing."""

from __future__ import annotations

import psutil
import pytest

from lightning_llm.models import LlamaConfig
from lightning_llm.testing import run_distributed
from lightning_llm.testing.setup_memory import measure_setup_memory
from tests._optional import requires_deepspeed


def test_zero3_setup_allocates_only_the_rank_shard():
    # The 1B preset's widths (a 1 GB tied embedding, 232 MiB blocks) with 2 of its 16 layers, to keep CI fast.
    config = LlamaConfig.from_name("1B", n_layers=2)
    rows = run_distributed(measure_setup_memory, 4, config, timeout=600)
    for rank, row in enumerate(rows):
        assert row["shard"] * 4 == pytest.approx(row["model"], rel=0.01), "ZeRO 3 should split the weights in 4"
        # Measured: 404-406 MiB for a 367 MiB shard (bound 425 MiB); eager construction peaked at 2468 MiB.
        assert row["peak"] <= row["shard"] + row["block"] / 4, (
            f"rank {rank}: peak RSS grew by {row['peak'] / 2**20:.0f} MiB during setup; its shard is "
            f"{row['shard'] / 2**20:.0f} MiB and one block {row['block'] / 2**20:.0f} MiB"
        )


@requires_deepspeed
def test_deepspeed_zero3_builds_only_the_rank_partitions():
    """LLMDeepSpeedStrategy ZeRO 3: built on meta, each rank allocates its partitions and the init fills them in
    chunks. Under zero.Init each module was whole for a moment (the 250 MiB embedding here, and the tied head's own
    250 MiB weight before the tie), far above the bound."""
    config = LlamaConfig.from_name("1B", n_layers=2, vocab_size=32000)
    rows = run_distributed(measure_setup_memory, 2, config, 3, None, "deepspeed", timeout=600)
    for rank, row in enumerate(rows):
        assert row["shard"] * 2 == pytest.approx(row["model"], rel=0.01), "ZeRO 3 should split the weights in 2"
        assert row["built"] <= row["shard"] + row["block"] / 4, (
            f"rank {rank}: RSS grew by {row['built'] / 2**20:.0f} MiB while the model was built and initialized; its "
            f"partitions are {row['shard'] / 2**20:.0f} MiB and one block {row['block'] / 2**20:.0f} MiB"
        )


def test_plan_70b_allocates_nothing(tmp_path):
    from lightning_llm.cli import plan

    config = tmp_path / "70b.yaml"
    config.write_text(
        "model:\n  class_path: lightning_llm.models.CausalLM\n  init_args:\n    config: 70B\n"
        "trainer:\n  devices: 8\n  num_nodes: 8\n  strategy:\n    class_path: lightning_llm.strategies.LLMParallelStrategy\n"
        "    init_args:\n      tensor_parallel_size: 8\n"
    )
    before = psutil.Process().memory_info().rss
    report = plan(["--config", str(config)])
    grown = psutil.Process().memory_info().rss - before
    assert "70." in report.splitlines()[0]  # 70.xB parameters planned
    assert grown < 1 << 30, f"plan grew RSS by {grown / 2**30:.1f} GiB; 70B in fp32 is 280 GB, nothing may be allocated"

"""Context parallelism on a hybrid model (Mamba-2 layers between attention layers): memory and step time, 2 CPU ranks.

Usage::

    python benchmarks/context_parallel_hybrid.py --seq-lens 2048 8192 --rounds 3

The model is Hugging Face's Bamba (4 layers, hidden 128: Mamba-2 in layers 0 and 2 with 8 heads of 32 channels,
attention in layers 1 and 3 with 4 query / 2 key-value heads; transformers' torch path of Mamba-2), fp32, on 2 gloo
ranks. Under context parallelism its attention goes by the ring or Ulysses and its Mamba-2 mixers compute on whole
sequences (``lightning_llm.parallel.cp.gathered``): by batch rows when the micro-batch divides by C, otherwise on one
rank each in turn (layer 0's on rank 0, layer 2's on rank 1).

- **Memory** (the longest length): torch's ``MemTracker`` around forward, loss and backward of one micro-batch; the
  peak of the bytes that are not parameters, buffers, gradients or optimizer state, per rank. C = 1 (each rank the
  whole micro-batch, no parallelism), then C = 2 by the ring, at micro-batches of 2 (mixers by batch rows) and 1
  (each mixer on one rank), and at 1 again with every block fully checkpointed.
- **Time** (each length, micro-batch 2): one training step (forward, loss, backward, AdamW) for C = 1, C = 2 ring and
  C = 2 Ulysses, alternated in a shuffled order per round after a warm-up step; seconds per step and the ratios
  to C = 1 as median (min, max).
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import alternate, ratios, spread

from lightning_llm.testing import run_distributed

MiB = 2**20
SIDES = ("C=1", "ring", "ulysses")


class _LM(L.LightningModule):
    def __init__(self, seq_len: int) -> None:
        super().__init__()
        from transformers import BambaConfig, BambaForCausalLM

        config = BambaConfig(
            vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4, attn_layer_indices=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2,
            mamba_d_state=16, mamba_chunk_size=256, max_position_embeddings=seq_len,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = BambaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1], use_cache=False).logits  # a cache would be filled twice when recomputed
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _model(side: str, batch: torch.Tensor, checkpointing: str = "none") -> _LM:
    from lightning_llm.modeling.blocks import find_blocks
    from lightning_llm.modeling.structure import traced_blocks
    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    module = _LM(batch.shape[1] - 1)
    checkpoint = lambda blocks, entries: apply_activation_checkpointing(blocks, mode=checkpointing, entries=entries)  # noqa: E731
    if side == "C=1":
        checkpoint(find_blocks(module)[1], None)
        return module
    traced = traced_blocks(module, lambda move: module.training_step(move(batch), 0))
    dims = ParallelDims.for_world(dist.get_world_size(), cp=dist.get_world_size(), replicate_all=True)
    dims.build_mesh("cpu")
    parallelize(module, dims, zero_stage=0, blocks=traced.override(module), traced=traced,
                context_parallel_method=side, activation_checkpointing=checkpoint)  # fmt: skip
    return module


def _tokens(micro_batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 64, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))


def _peak_activation_bytes(side: str, micro_batch: int, seq_len: int, checkpointing: str = "none") -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    batch = _tokens(micro_batch, seq_len)
    module = _model(side, batch, checkpointing)
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        module.training_step(batch, 0).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    held = {str(kind).split(".")[-1]: nbytes for kind, nbytes in peak.items()}
    return held["Total"] - sum(held.get(kind, 0) for kind in ("PARAM", "BUFFER", "GRAD", "OPT"))


def _step_times(seq_len: int, rounds: int) -> dict[str, list[float]]:
    batch = _tokens(2, seq_len)
    models = {side: _model(side, batch) for side in SIDES}
    optimizers = {side: torch.optim.AdamW(models[side].parameters(), lr=1e-4) for side in SIDES}

    def step(side: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        models[side].training_step(batch, 0).backward()
        optimizers[side].step()
        optimizers[side].zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    for side in SIDES:
        step(side)  # warm-up: allocator growth, first-call dispatch
    return alternate(SIDES, step, rounds)


def _measure(seq_lens: list[int], rounds: int) -> tuple[dict, dict]:
    dist.init_process_group("gloo")
    longest = max(seq_lens)
    memory = {
        (side, micro_batch, checkpointing): _peak_activation_bytes(side, micro_batch, longest, checkpointing)
        for side in ("C=1", "ring")
        for micro_batch, checkpointing in ((2, "none"), (1, "none"), (1, "full"))
    }
    return memory, {seq_len: _step_times(seq_len, rounds) for seq_len in seq_lens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ranks = run_distributed(_measure, 2, args.seq_lens, args.rounds, timeout=3600)
    for micro_batch, checkpointing in ((2, "none"), (1, "none"), (1, "full")):
        whole = [memory[("C=1", micro_batch, checkpointing)] for memory, _ in ranks]
        split = [memory[("ring", micro_batch, checkpointing)] for memory, _ in ranks]
        per_rank = ", ".join(f"{s / MiB:.0f} MiB ({s / w:.2f})" for s, w in zip(split, whole))
        print(f"seq {max(args.seq_lens)}, micro-batch {micro_batch}, checkpointing {checkpointing}: C=1 "
              f"{whole[0] / MiB:.0f} MiB per rank; C=2 ring {per_rank} per rank (of C=1)")  # fmt: skip
    for seq_len, times in ranks[0][1].items():
        for side in SIDES:
            print(f"seq {seq_len:>6} {side:>8}: {spread(times[side])} s per training step")
        for side in SIDES[1:]:
            print(f"seq {seq_len:>6} {side} / C=1: {spread(ratios(times[side], times['C=1']))}")


if __name__ == "__main__":
    main()

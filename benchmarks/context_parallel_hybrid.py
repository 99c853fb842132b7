"""Context parallelism on a hybrid model (Mamba-2 layers between attention layers): memory and step time, 2 CPU ranks.

Usage::

    python benchmarks/context_parallel_hybrid.py --seq-lens 2048 8192 --rounds 3
    python benchmarks/context_parallel_hybrid.py --model lfm2 --micro-batch 1 --seq-lens 2048 8192 --rounds 3

The model is Hugging Face's Bamba (4 layers, hidden 128: Mamba-2 in layers 0 and 2 with 8 heads of 32 channels,
attention in layers 1 and 3 with 4 query / 2 key-value heads; transformers' torch path of Mamba-2), fp32, on 2 gloo
ranks. Under context parallelism its attention goes by the ring or Ulysses and its Mamba-2 mixers compute on whole
sequences (``lightning_llm.parallel.cp.gathered``): by batch rows when the micro-batch divides by C, otherwise on one
rank each in turn (layer 0's on rank 0, layer 2's on rank 1).

- **Memory** (the longest length): torch's ``MemTracker`` around forward, loss and backward of one micro-batch; the
  peak of the bytes that are not parameters, buffers, gradients or optimizer state, per rank. C = 1 (each rank the
  whole micro-batch, no parallelism), then C = 2 by the ring, at micro-batches of 2 (mixers by batch rows) and 1
  (each mixer on one rank), and at 1 again with every block fully checkpointed.
With ``--model lfm2`` it is Hugging Face's LFM2 (4 layers, hidden 128: a gated short convolution of kernel 3 in
layers 0 and 2, attention in 1 and 3), whose convolutions run on each rank's own positions with a halo of 2
(``lightning_llm.parallel.cp.halo``); the timed sides then add "ring, whole": C = 2 ring with the halo's probe turned
off, so the convolutions run on one rank each in turn (at micro-batch 1) as they did before the halo.

- **Time** (each length, ``--micro-batch``, default 2): one training step (forward, loss, backward, AdamW) for C = 1, C = 2 ring and
  C = 2 Ulysses, alternated in a shuffled order per round after a warm-up step; seconds per step and the ratios
  to C = 1 as median (min, max).
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import alternate, ratios, spread

from lightning_llm.testing import run_distributed

MiB = 2**20
SIDES = ("C=1", "ring", "ulysses")


class _LM(L.LightningModule):
    def __init__(self, seq_len: int, model: str = "bamba") -> None:
        super().__init__()
        import transformers

        common = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len)  # fmt: skip
        if model == "lfm2":
            config = transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"] * 2)
        else:
            config = transformers.BambaConfig(
                **common, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2,
                mamba_d_state=16, mamba_chunk_size=256,
            )  # fmt: skip
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1], use_cache=False).logits  # a cache would be filled twice when recomputed
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


@contextmanager
def _halo_probe(on: bool):
    """The halo's probe as is, or turned off (every mixer then runs on whole sequences, as before the halo)."""
    from lightning_llm.parallel.cp import halo

    kept, halo.PROBE = halo.PROBE, halo.PROBE if on else 0
    try:
        yield
    finally:
        halo.PROBE = kept


def _model(side: str, batch: torch.Tensor, model: str, checkpointing: str = "none") -> _LM:
    from lightning_llm.modeling.blocks import find_blocks
    from lightning_llm.modeling.structure import traced_blocks
    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    module = _LM(batch.shape[1] - 1, model)
    checkpoint = lambda blocks, entries: apply_activation_checkpointing(blocks, mode=checkpointing, entries=entries)  # noqa: E731
    if side == "C=1":
        checkpoint(find_blocks(module)[1], None)
        return module
    traced = traced_blocks(module, lambda move: module.training_step(move(batch), 0))
    dims = ParallelDims.for_world(dist.get_world_size(), cp=dist.get_world_size(), replicate_all=True)
    dims.build_mesh("cpu")
    parallelize(module, dims, zero_stage=0, blocks=traced.override(module), traced=traced,
                context_parallel_method=side.split(",")[0], activation_checkpointing=checkpoint)  # fmt: skip
    return module


def _tokens(micro_batch: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, 64, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))


def _peak_activation_bytes(side: str, micro_batch: int, seq_len: int, model: str, checkpointing: str = "none") -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    batch = _tokens(micro_batch, seq_len)
    module = _model(side, batch, model, checkpointing)
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker, _halo_probe(side != "ring, whole"):
        module.training_step(batch, 0).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    held = {str(kind).split(".")[-1]: nbytes for kind, nbytes in peak.items()}
    return held["Total"] - sum(held.get(kind, 0) for kind in ("PARAM", "BUFFER", "GRAD", "OPT"))


def _step_times(seq_len: int, rounds: int, model: str, micro_batch: int) -> dict[str, list[float]]:
    batch = _tokens(micro_batch, seq_len)
    sides = _sides(model)
    models = {side: _model(side, batch, model) for side in sides}
    optimizers = {side: torch.optim.AdamW(models[side].parameters(), lr=1e-4) for side in sides}

    def step(side: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        models[side].training_step(batch, 0).backward()
        optimizers[side].step()
        optimizers[side].zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    for side in sides:
        with _halo_probe(side != "ring, whole"):
            step(side)  # warm-up: allocator growth, first-call dispatch, the halo's probe
    return alternate(sides, step, rounds)


def _sides(model: str) -> tuple[str, ...]:
    return (*SIDES, "ring, whole") if model == "lfm2" else SIDES


def _measure(seq_lens: list[int], rounds: int, model: str, micro_batch: int) -> tuple[dict, dict]:
    dist.init_process_group("gloo")
    longest = max(seq_lens)
    memory = {
        (side, mb, checkpointing): _peak_activation_bytes(side, mb, longest, model, checkpointing)
        for side in ("C=1", "ring", *(("ring, whole",) if model == "lfm2" else ()))
        for mb, checkpointing in ((2, "none"), (1, "none"), (1, "full"))
    }
    return memory, {seq_len: _step_times(seq_len, rounds, model, micro_batch) for seq_len in seq_lens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("bamba", "lfm2"), default="bamba")
    parser.add_argument("--micro-batch", type=int, default=2, help="of the timed steps")
    args = parser.parse_args()
    ranks = run_distributed(_measure, 2, args.seq_lens, args.rounds, args.model, args.micro_batch, timeout=3600)
    for micro_batch, checkpointing in ((2, "none"), (1, "none"), (1, "full")):
        whole = [memory[("C=1", micro_batch, checkpointing)] for memory, _ in ranks]
        for side in ("ring", "ring, whole") if args.model == "lfm2" else ("ring",):
            split = [memory[(side, micro_batch, checkpointing)] for memory, _ in ranks]
            per_rank = ", ".join(f"{s / MiB:.0f} MiB ({s / w:.2f})" for s, w in zip(split, whole))
            print(f"seq {max(args.seq_lens)}, micro-batch {micro_batch}, checkpointing {checkpointing}: C=1 "
                  f"{whole[0] / MiB:.0f} MiB per rank; C=2 {side} {per_rank} per rank (of C=1)")  # fmt: skip
    sides = _sides(args.model)
    for seq_len, times in ranks[0][1].items():
        for side in sides:
            print(f"seq {seq_len:>6} micro-batch {args.micro_batch} {side:>11}: {spread(times[side])} s per step")
        for side in sides[1:]:
            print(f"seq {seq_len:>6} {side} / C=1: {spread(ratios(times[side], times['C=1']))}")
        if args.model == "lfm2":
            print(f"seq {seq_len:>6} ring / ring, whole: {spread(ratios(times['ring'], times['ring, whole']))}")


if __name__ == "__main__":
    main()

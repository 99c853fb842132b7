"""Context parallelism: every sequence split over the ``cp`` ranks from the embedding to the output, exact.

- :mod:`.layout`: which tokens each rank holds (head-tail / zig-zag chunks), global positions;
- :mod:`.collectives`: autograd-aware gathers of sequence shards;
- :mod:`.attention`: a shard's queries over the whole sequence (keys/values all-gathered, causal by global position);
- :mod:`.ring`: the same with key/value shards sent around the ring and partial outputs merged by log-sum-exp (the
  CPU path: measured faster from 8K tokens on 2 gloo ranks, and at most two key/value shards held);
- :mod:`.masks`: which keys a query sees by global position (causal, a sliding window, packed documents);
- :mod:`.interception`: routing a model's attention there (Hugging Face's attention registry, or SDPA calls
  inside the blocks), with the variants that cannot be distributed exactly refused;
- :mod:`.sharding`: the model's input sharded (token ids, global ``position_ids``) and its output gathered;
- :mod:`.multihead`: ``nn.MultiheadAttention`` (PyTorch's Transformer layers) through the CP attention;
- :mod:`.positions`: a learned position table the forward looks up with ``arange(T)`` read at global positions;
- :mod:`.gathered`: other sequence mixers (Mamba, gated delta-net, short convolutions) run on whole sequences;
- :mod:`.owner`: such a mixer run on one rank at a time where the micro-batch cannot split by batch rows.
- :mod:`.halo`: a mixer its first forward shows local (a short convolution, an MLP) run on each rank's own
  positions, each chunk after the few positions before it.
"""

from lightning_llm.parallel.cp.apply import apply_context_parallel, check_context_parallel, refuse_blocks_not_called
from lightning_llm.parallel.cp.attention import context_parallel_attention, count_queries
from lightning_llm.parallel.cp.layout import CPGroup, zigzag_positions
from lightning_llm.parallel.cp.ring import ring_attention

__all__ = [
    "CPGroup",
    "apply_context_parallel",
    "check_context_parallel",
    "context_parallel_attention",
    "count_queries",
    "refuse_blocks_not_called",
    "ring_attention",
    "zigzag_positions",
]

"""Tensor (+ sequence) parallelism: which plan applies (:mod:`.plan`, Hugging Face styles in :mod:`.hf_styles`, the
module names a plan names in :mod:`.patterns`, the entries sequence parallelism adds in :mod:`.sequence_parallel_plan`),
the styles themselves (:mod:`.styles`, fused projections in :mod:`.fused`, MoE experts in :mod:`.experts`), head counts
(:mod:`.heads`), gradients of parameters left whole (:mod:`.replicated_grads`), and applying it (:mod:`.apply`)."""

"""Building large models without allocating them whole: which init a model uses (:mod:`.entry`), allocating and
initializing a meta model's shards (:mod:`.materialize`), and the same for DeepSpeed ZeRO-3 partitions
(:mod:`.zero3_build`, :mod:`.zero3_init`)."""

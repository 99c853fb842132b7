"""Every checkpoint concern below the Lightning callback: where files live (:mod:`.fs`, any fsspec filesystem),
the commit protocol and rotation (:mod:`.files`, :mod:`.commit`), content checksums (:mod:`.checksums`), strict key
matching (:mod:`.keys`), save failures shared by every rank (:mod:`.errors`), sharded DCP checkpoints (:mod:`.dcp`),
DeepSpeed's (:mod:`.deepspeed`), host staging and the background writer (:mod:`.staging`, :mod:`.write_gate`),
random-generator state (:mod:`.rng_state`), verified single-file loads (:mod:`.verified_load`) and consolidation into
one file (:mod:`.consolidate`).

Used by the strategies and by :class:`~lightning_llm.callbacks.CheckpointRotation`; imports neither.
"""

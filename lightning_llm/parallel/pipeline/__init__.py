"""Pipeline parallelism for models not written for it: where stages start (:mod:`.split`, balanced by the modelled
FLOPs of :mod:`.costs`), the gates that cut the user's module into stages (:mod:`.gates`, with the stage running now in
:mod:`.stage_state` and the stand-ins for what other stages hold in :mod:`.stand_ins`), torch's stages and schedules
(:mod:`.stages`). Lightning's steps run through a schedule are the strategy's (``strategies.pipelined_steps``)."""

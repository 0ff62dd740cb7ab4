"""How a model is spread over ranks, built only on the Communicator.

``data/`` (DDP, its reducer and buckets, comm hooks, the parameter server, the
sampler), ``zero`` (ZeRO-1/2), ``checkpoint``; ``tensor/`` (Megatron's column and
row split), ``pipeline/`` (schedules as data and their runtime), ``fsdp/`` (ZeRO-3)
and ``grid`` (the 3D process grid).
"""

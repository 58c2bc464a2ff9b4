"""Tensor parallelism: the process group (:mod:`.parallel`), the Megatron-style sharding rules
(:mod:`.shard`), the vocab-parallel embedding (:mod:`.embedding`) and the worker process of
ranks 1..N-1 (:mod:`.worker`, run as ``python -m``)."""

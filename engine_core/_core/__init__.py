"""Pure engine logic: requests, block pool and prefix keys, KV-cache bookkeeping, the scheduler
and the types it emits. No event loop, sockets or tensors here."""

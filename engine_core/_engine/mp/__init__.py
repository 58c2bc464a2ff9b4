"""The client of one engine-core process: ``client`` (``MPClient`` and its state table),
``inbox`` (reading what the engine sends, noticing its silences), ``death`` (the errors a dead
engine's calls raise) and ``launcher`` (where the engine runs: a child process here, or
elsewhere through another launcher such as Ray's)."""

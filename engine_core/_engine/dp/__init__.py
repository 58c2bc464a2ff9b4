"""Data parallelism on the client side: the client that routes requests over several engine
cores (``client``) and the statistics summed over them (``stats``)."""

"""The pipes between a client and its engine-core process: the two one-way ends and what opens
them (``pipes``), Unix stream pipes (``unix``, waiting on descriptors with ``fd_wait``), the
addresses, socket options and CURVE keys (``addresses``), the sockets of an engine that dials
its client (``dial``), and the authenticated transport of prefill/decode KV handoffs between
hosts (``pd_transport``)."""

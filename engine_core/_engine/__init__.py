"""The engine: one step of EngineCore, the engine-core process, its wire messages and sockets,
and the clients that drive it in process or across the process boundary."""

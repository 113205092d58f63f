"""Inter-process communication: the msgpack codec, the shared-memory ring, ZeroMQ channels."""

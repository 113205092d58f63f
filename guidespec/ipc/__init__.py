"""Inter-process communication: the msgpack codec, the shared-memory ring, the mask arena, the
step broadcast (ring and remote stream), ZeroMQ channels."""

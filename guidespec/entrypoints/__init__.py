"""What a user starts: the command line, the OpenAI-compatible server, tool calling, the
benchmark and sweep commands, and EAGLE head training. Everything here drives an ``LLM``."""

"""The engine's processes: their config resolved from the user's arguments (``engine_config``),
the launcher that creates their shared resources and starts them, the zygote they are forked
from, the entry point each runs (``child.py``), the Ray executor that places ranks as actors,
and the supervisor that watches them and restarts them after a death (``supervisor``).
``guidespec.llm`` uses this; what a user starts is in ``guidespec.entrypoints``."""

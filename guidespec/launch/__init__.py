"""The engine's processes: the launcher that creates their shared resources and starts them, the
zygote they are forked from, the entry point each runs (``child.py``), and the Ray executor
that places ranks as actors. ``guidespec.llm`` uses this; what a user starts is in
``guidespec.entrypoints``."""

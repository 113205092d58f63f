"""The scheduler process (its loop: ``scheduler.py``; its stages: ``intake.py``, ``table.py``,
``step_channel.py``, ``emit.py``, ``health.py``): requests and their queue, batches, the step
broadcast, grammar ownership (``grammar/``: matchers, compiles, the compile process, early
closing), output and jump-forward, and speculation's scheduler side (``speculation/``)."""

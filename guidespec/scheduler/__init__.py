"""The scheduler process (its loop: ``scheduler.py``): requests and their queue, batches, the
step broadcast, grammar ownership (``grammar/``: matchers, compiles, the compile process, early
closing), output and jump-forward, and speculation's scheduler side (``speculation/``)."""

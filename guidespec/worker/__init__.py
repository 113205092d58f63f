"""A worker process (its loop: ``worker.py``), one per tensor-parallel rank: the model, its KV
cache, the sampler and verification, mask application, TP collectives, device placement and
CUDA graphs, the CPU kernels, and speculation's worker side (``drafting/``)."""

"""Drafting on the workers: draft models, EAGLE heads, and their steps as CUDA graphs (draft
steps alone, or whole speculative steps with verification)."""

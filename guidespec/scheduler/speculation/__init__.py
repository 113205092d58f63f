"""Speculation on the scheduler's side: the proposer that decides each row's drafts, and the
drafters that need no model (n-gram prompt lookup, JSON-text drafting); model drafters run on
the workers (``guidespec.worker.drafting``)."""

"""The scheduler process: requests, queues, batches, (later) grammar ownership."""

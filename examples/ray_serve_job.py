"""A Ray job that deploys guidespec's data-parallel replicas on the cluster it runs in, asks
them one guided question, and leaves the application serving (Ray Serve keeps it after the job
ends; ``serve shutdown`` stops it).

    ray job submit --address http://HEAD:8265 --working-dir . -- python examples/ray_serve_job.py [REPLICAS]
"""

from __future__ import annotations

import json
import sys

import httpx
import ray
from ray import serve

from guidespec.entrypoints.ray_serve import build_app

replicas = int(sys.argv[1]) if len(sys.argv) > 1 else 2
ray.init(address="auto")
serve.start(http_options={"host": "0.0.0.0", "port": 8000})
serve.run(build_app(num_replicas=replicas), name="guidespec", route_prefix="/")
with open("examples/person.schema.json") as f:
    schema = json.load(f)
reply = httpx.post(
    "http://127.0.0.1:8000/v1/chat/completions",
    json={
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "A person as JSON"}],
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    },
    timeout=300,
)
print(reply.headers.get("x-guidespec-replica"), reply.json()["choices"][0]["message"]["content"])
print(f"guidespec: {replicas} replicas serving on port 8000 of the head node (serve shutdown stops them)")

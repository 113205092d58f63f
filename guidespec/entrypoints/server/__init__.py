"""``guidespec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``LLM``.

Routes: ``/v1/models``, ``/v1/completions`` (text or token ids), ``/v1/chat/completions`` (the
chat template: ``--chat-template``, else the tokenizer's; a model without one, a base model,
answers 400 saying so), both streaming over server-sent events; ``response_format`` (``json_schema``,
``json_object``) and the fields vLLM users send (``guided_json``, ``guided_regex``,
``guided_grammar``, ``guided_choice``, ``guided_decoding_backend``, ``top_k``,
``repetition_penalty``, ``ignore_eos``); ``/health``; ``/metrics`` for Prometheus.

Errors are OpenAI-style bodies (``{"error": {"message", "type", "param", "code"}}``) whose status
says whose fault it is: 400 for a request the engine refuses (invalid schema, context overflow,
bad or unsupported parameter), 401 for a wrong or missing API key (``--api-key`` guards the
``/v1`` routes, as vLLM's: ``/health`` and ``/metrics`` stay open), 404 for an unknown model or
route, 413 for a body over ``MAX_BODY_BYTES`` (by its ``Content-Length``, or counted as a chunked
upload arrives), 422 for a body of the wrong shape; 500 for a bug of ours
(its traceback in this server's log, never in the response), and 500 with ``code``
``"grammar_failed"`` where the grammar stopped before the output was complete (a backend's limit
met mid-way: there is no valid answer to give; ``X-Guidespec-Grammar-Restarts`` and
``usage.grammar_restarts`` count the times a request started again on the next backend
instead); 503 with ``Retry-After`` while the engine is restarting after a death, or while the
server drains for shutdown. A stream that fails after its first byte ends with an error event
of the same status (and code). The engine keeps serving the others. A client that disconnects
aborts its request, which frees its slot (``guidespec_num_requests_running`` in ``/metrics``).

The engine restarts itself (``LLM(restart_on_failure=True)``); if it dies in a crash loop the
server exits with a non-zero status, for its supervisor. SIGTERM (or Ctrl-C) drains: new
requests get 503, those in flight finish (up to ``shutdown_timeout_s``), then the engine stops.

The package, by job: ``schemas`` (the OpenAPI document's models), ``translate`` (OpenAI's
requests to the engine's and its outputs back), ``errors`` (refusals as OpenAI answers them),
``metrics`` (the Prometheus series), ``routes`` (the routes, running each generation) and
``app`` (the app, its error handlers and middleware, and the uvicorn server).
"""

from __future__ import annotations

from guidespec.entrypoints.server.app import MAX_BODY_BYTES, create_app, run_server
from guidespec.entrypoints.server.errors import RETRY_AFTER_S

__all__ = ["MAX_BODY_BYTES", "RETRY_AFTER_S", "create_app", "run_server"]

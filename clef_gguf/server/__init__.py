"""The SystemOne HTTP server (``clef-gguf serve``): a package of its own, as in llama-cpp-python.

- ``app``: the app factory (``create_app``) and the ``serve`` command;
- ``routes``: the endpoints, and the error bodies of what the framework refuses itself;
- ``jobs``: a request's waits (a tokenizer thread, then the model) and their refusals;
- ``state``: the model being served (loading in the background, health);
- ``workqueue``: the bounded stages in front of the single model: tokenizer threads, then a queue;
- ``batch``: batch requests (avrik-sdk's ``state: [{id, text}, ...]`` or ``requests: [...]``);
- ``http``: request context, JSON bodies, auth and error responses;
- ``schema``: the wire contract as pydantic models (``/openapi.json``, batch validation).
"""

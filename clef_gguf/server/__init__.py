"""The SystemOne HTTP server (``clef-gguf serve``): a package of its own, as in llama-cpp-python.

- ``app``: the FastAPI application and the ``serve`` command;
- ``state``: the model being served (loading in the background, health);
- ``workqueue``: the bounded stages in front of the single model: tokenizer threads, then a queue;
- ``batch``: batch requests (avrik-sdk's ``state: [{id, text}, ...]`` or ``requests: [...]``);
- ``http``: request context, JSON bodies, auth and error responses;
- ``schema``: the OpenAPI schema of the wire format.
"""

"""The SystemOne HTTP server (``clef-gguf serve``): a package of its own, as in llama-cpp-python.

- ``app``: the FastAPI application and the ``serve`` command;
- ``state``: the model being served (loading in the background, health);
- ``workqueue``: the bounded queue in front of the single model;
- ``batch``: ``{"inputs": [...]}`` batch requests;
- ``http``: request context, JSON bodies, auth and error responses;
- ``schema``: the OpenAPI schema of the wire format.
"""

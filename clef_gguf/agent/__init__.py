"""``clef-gguf mcp``: the model for AI agents, over the Model Context Protocol.

``mcp_server`` is the command: the loaded models as two MCP tools (``decide``, ``models``) on
stdin/stdout, for a desktop agent or an IDE that starts it as a child process. The SDK (``mcp``,
2.x) is the optional extra ``clef-gguf[mcp]``.
"""

"""The MCP traffic kind: the JSON-RPC vocabulary, one attempt at the server, the cuts and
resumption of its event streams, and the adapter."""

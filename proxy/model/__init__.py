"""The model traffic kind (OpenAI, Anthropic): dialects, streams, entries, exits, answers, the
exchange, correlating tool results to calls, results joined from named runs, and the adapter."""

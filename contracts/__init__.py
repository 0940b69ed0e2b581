"""Contract model and enforcement, free of HTTP: loading, conditions, the engine, stores."""

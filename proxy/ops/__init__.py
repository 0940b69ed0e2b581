"""The operator surface: app assembly (the one place that wires every traffic kind), the admin
API, operations, the replay command, the worker supervisor and its link, connection limits."""

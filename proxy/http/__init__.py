"""The plain HTTP traffic kind: the HTTP tool adapter and the guarded listener."""

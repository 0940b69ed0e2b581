"""Transport: the aiohttp proxy, routing, forwarding, one adapter per traffic kind, the CLI."""

"""MaruCache core: the shared-memory pool, keys, the index protocol, server and client.

This package imports nothing else of MaruCache's; the connector, sidecar and
operator build on it.
"""

__version__ = "0.1.0"

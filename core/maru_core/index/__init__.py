"""The index: registry (pure), server, clients, metrics and the `marucache index` command."""

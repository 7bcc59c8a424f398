"""Real-engine test support: a tiny model builder, a vLLM engine runner in its
own process, and helpers that start a real index on a temporary pool.

Used by the end-to-end tests, `marucache demo` and the TTFT benchmark. Nothing
here is imported by the connector itself.
"""

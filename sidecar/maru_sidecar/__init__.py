"""The MaruCache sidecar: hands the pool to vLLM over a Unix socket and exports the cache's metrics.

One runs next to every vLLM container (or as a local process in embedded
mode). It opens the pool device, gives its file descriptor to the connector
(`maru_sidecar.handoff_server`), sums the connector's stats regions
(`maru_core.stats_aggregate`) and serves `/metrics`, `/healthz` and `/readyz`
(`maru_sidecar.endpoints`). `maru_sidecar.app` builds and runs all of it.
"""

"""Tools on top of the product packages: real-engine test support (a tiny
model builder, a vLLM engine runner in its own process, helpers that start a
real index and sidecar on a temporary pool, vLLM's scheduler driven step by
step), the Kubernetes API stand-in the operator is tested against, and
`marucache demo`.

Used by the tests, the demo and the benchmarks. No product package
(maru_core, maru_connector, maru_sidecar, maru_operator) imports it: the
import contract in pyproject.toml holds that edge.
"""

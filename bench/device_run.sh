# Shared by the GPU scripts of bench/ (sourced, not run): set `out` first.
#   run NAME SECONDS COMMAND...   the command's output into $out/NAME.txt, with a
#                                 time limit; a failure sets failed=1 and goes on
#   gpu_info                      the GPU, driver, torch and Triton into $out/gpu.txt
failed=0

run() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local status=0
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        echo "!! $name failed (exit $status)"
        failed=1
    fi
    tail -3 "$out/$name.txt"
}

gpu_info() {
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
        >>"$out/gpu.txt" 2>&1
}

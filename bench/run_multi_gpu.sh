#!/usr/bin/env bash
# Prefix hits on several GPUs of one host (bench/multi_gpu.py), as many
# variants as the machine's GPUs allow, in one go (run from the project root
# on the GPU machine):
#
#   bash bench/run_multi_gpu.sh OUT_DIR
#
#   1 GPU:  TP=2 with both ranks on GPU 0 (all-reduce on gloo), the same with
#           NCCL asked for (it falls back to gloo, saying so, where NCCL
#           refuses two ranks on one GPU), 2 engines loading at once on GPU 0
#   2 GPUs: TP=2, 2 engines
#   4 GPUs: TP=2, TP=4, 4 engines
#   8 GPUs: TP=2, TP=4, TP=8, 8 engines
#
# Each stage runs under `timeout`, writes OUT_DIR/<stage>.txt and the
# harness's JSON (and PNG where matplotlib imports) and prints its table; a
# stage that fails does not stop the others; the script exits non-zero when
# any failed. On one GPU the whole script takes well under 9 minutes.
set -u
out=${1:?usage: run_multi_gpu.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tools:tests/connector${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
failed=0
results=()

# The index needs sortedcontainers, the stores xxhash: say so at once if one is missing.
if ! python3 -c "import torch, numpy, msgpack, sortedcontainers, xxhash" 2>"$out/imports.txt"; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        echo "== installing the carried wheels (.whl) into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    if ! python3 -c "import torch, numpy, msgpack, sortedcontainers, xxhash" 2>>"$out/imports.txt"; then
        echo "!! a package the harness needs is missing (the index needs sortedcontainers, the"
        echo "!! stores xxhash); carry them as wheels in .whl/:"
        cat "$out/imports.txt"
        exit 1
    fi
fi

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>>"$out/imports.txt")
if ! [[ "$gpus" =~ ^[0-9]+$ ]] || [ "$gpus" -lt 1 ]; then
    echo "!! no CUDA device seen by torch (device_count: '${gpus}'):"
    cat "$out/imports.txt"
    exit 1
fi
{ nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id --format=csv,noheader
  nvidia-smi topo -m; df -h /dev/shm; ulimit -l; } >"$out/machine.txt" 2>&1
echo "== $gpus GPU(s); /dev/shm: $(df -h --output=avail /dev/shm | tail -1) free"

stage() {  # NAME SECONDS ARGS...: bench/multi_gpu.py ARGS under `timeout`
    local name=$1 limit=$2
    shift 2
    echo "== $name: multi_gpu.py $*"
    local start=$SECONDS
    timeout -k 10 "$limit" python3 bench/multi_gpu.py --out "$out" --tag "$name" \
        --timeout $((limit - 25)) "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    grep -v '^\[' "$out/$name.txt" | grep -v -i -e warn -e '^ *warnings\.' | tail -12
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "!! $name ran past ${limit}s and was stopped"
        echo "!! $name failed (exit $rc); its log: $out/$name.txt"
        failed=1
        results+=("$name: FAILED (exit $rc)")
    else
        results+=("$name: passed")
    fi
    echo "   ($((SECONDS - start)) s)"
}

case $gpus in
1)
    stage tp2_one_gpu_gloo 170 --experiment tp --processes 2 --gpus 1 --collective gloo
    stage engines2_one_gpu 170 --experiment engines --processes 2 --gpus 1
    stage tp2_one_gpu_nccl 120 --experiment tp --processes 2 --gpus 1 --collective nccl \
        --modes sync --repeats 2 ;;
2|3)
    stage tp2 240 --experiment tp --processes 2 --gpus 2
    stage engines2 240 --experiment engines --processes 2 --gpus 2 ;;
4|5|6|7)
    stage tp2 200 --experiment tp --processes 2 --gpus 2
    stage tp4 240 --experiment tp --processes 4 --gpus 4
    stage engines4 300 --experiment engines --processes 4 --gpus 4 ;;
*)
    stage tp2 200 --experiment tp --processes 2 --gpus 2
    stage tp4 240 --experiment tp --processes 4 --gpus 4
    stage tp8 300 --experiment tp --processes 8 --gpus 8
    stage engines8 420 --experiment engines --processes 8 --gpus 8 ;;
esac
echo "== summary"
printf '%s\n' "${results[@]}"
exit $failed

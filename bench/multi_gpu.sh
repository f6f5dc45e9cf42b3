#!/usr/bin/env bash
# The multi-GPU measurements (docs/parallel.md, "On a multi-GPU host") in parts that each fit one device command of
# 10 minutes, on a host with N GPUs. Run from the repository root with src/ and tests/ importable:
#
#     bash bench/multi_gpu.sh N OUT PART...      # e.g. bash bench/multi_gpu.sh 8 $OUT tests forward
#
# Parts (rough minutes on 8 H200s): tests (4), forward (6: the default shape, counts 1 2 4 8 up to N),
# forward-reference (3), render (5: the default request at 50 points, compiled BF16 and CUTLASS), serve (3),
# split (5: whole renders split and on one GPU, byte for byte). Each step has its own timeout, writes its JSON (or
# log) under OUT, and a failing step does not stop the next.
set -u
N=${1:?GPU count}
OUT=${2:?output folder}
shift 2
mkdir -p "$OUT"
COUNTS=$(for n in 1 2 4 8; do [ "$n" -le "$N" ] && printf '%s,' "$n"; done)
COUNTS=${COUNTS%,}
PROFILES=CUDNN_ATTN+compile+BF16,CUDNN_ATTN+compile+CUTLASS
# The host, once per call: GPUs and their links (NVLink or PCIe sets the all-to-all's speed), and /dev/shm, through
# which a split render's frames come back to the parent (~0.4 GB at the default request; Docker's default is 64 MB).
{ nvidia-smi --query-gpu=index,name,memory.total,power.limit --format=csv; nvidia-smi topo -m; df -h /dev/shm; } \
  > "$OUT/host.txt" 2>&1
echo "== host: $(grep -c H200 "$OUT/host.txt") H200 line(s); /dev/shm: $(df -h --output=avail /dev/shm | tail -1)"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s"
  tail -n 3 "$OUT/$name.log"
}
for part in "$@"; do
  case $part in
    tests) step pytest-gpu-parallel 560 python3 -m pytest -q -m gpu -rs tests/test_gpu_parallel.py ;;
    forward) step dit-step-split-default 560 python3 bench/dit_step.py --num-gpus "$COUNTS" --shape default \
      --only "$PROFILES,CUDNN_ATTN+eager+BF16" --out "$OUT/dit-step-split-default.json" ;;
    forward-reference) step dit-step-split-reference 300 python3 bench/dit_step.py --num-gpus "$COUNTS" \
      --only "$PROFILES,CUDNN_ATTN+eager+BF16" --out "$OUT/dit-step-split-reference.json" ;;
    render) step render-split-default 560 python3 bench/render.py --num-gpus "$N" --shape default \
      --profiles compile,compile+CUTLASS --warmup-steps 2 --out "$OUT/render-split-default.json" ;;
    serve) step serve-accept-split 400 python3 bench/serve_accept.py --num-gpus "$N" \
      --out "/tmp/serve-accept/serve-accept-split.json" && cp /tmp/serve-accept/*.json "$OUT/" ;;
    split) step split-default 560 python3 bench/split.py --num-gpus "$N" --steps 4 --shape default --skip-checks \
      --out "$OUT/split-default.json" ;;
    *) echo "unknown part $part (tests forward forward-reference render serve split)" >&2 ;;
  esac
done

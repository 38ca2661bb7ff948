#!/usr/bin/env bash
# Every GPU check of the README's "On a GPU" section, in one go, each part under its own time limit; a part that
# fails is reported and the next one runs. Writes one log per part under OUTDIR and prints a summary line per part.
#
#   bash benchmarks/gpu_session.sh OUTDIR [PART ...]
#
# Parts run in the order named. Default (all): info tests tests-oom megatron rollout rollout-attn gloo-probe sharded-diag
# grpo-110m grpo-tiny grpo-tiny-heap sharding-run sharding-run-tiny sharding-run1 sharding-layouts; `remaining`,
# `remaining2` and `remaining3` name those the last GPU session did not run on the current code, most wanted first, in
# three calls that each fit one 15-minute device slot (the parts' limits add up to 490-600 s each, `info` taking seconds
# of its 60; the wheels' install and the machine's start besides). By name only: tests-ipc and grpo-110m-ipc
# (weights.transport cuda_ipc: its GPU test, the 110 M step with it), async-110m and async-tiny (sync against
# rollout.mode async K = 1, one after the other), tests-sharded (the sharded GPU test alone),
# tests-kernel (the decode kernel's GPU test), rollout-bf16 (the bf16 rollout with its profile), rollout-tiles (the Triton
# decode kernel's tiles, TILES="32x4 64x8 ..."). ATTN="sdpa triton ..." picks rollout-attn's decode attentions. KTESTS
# picks tests-kernel's tests (-k). The peers (trl)
# and megatron-core must be importable (pip install trl megatron-core, or wheels on PYTHONPATH); a part whose package is
# missing says so in its log.
set -u
OUT=${1:?usage: gpu_session.sh OUTDIR [PART ...]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ALL="info tests tests-oom megatron rollout rollout-attn gloo-probe sharded-diag grpo-110m grpo-tiny grpo-tiny-heap sharding-run sharding-run-tiny sharding-run1 sharding-layouts"
REMAINING="info grpo-tiny async-110m async-tiny tests-kernel"  # limits: 490 s
REMAINING2="info megatron sharding-layouts"                       # 600 s
REMAINING3="info sharding-run tests"                              # 540 s
PARTS=${*:-$ALL}
PARTS=${PARTS//remaining3/$REMAINING3}
PARTS=${PARTS//remaining2/$REMAINING2}
PARTS=${PARTS//remaining/$REMAINING}
go() {  # seconds, command...: the part $name under its limit, its output in $OUT/$name.log
    local limit=$1 t0=$SECONDS
    shift
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "part $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
}
run() {
    name=$1
    case $name in
        info) go 60 bash -c 'nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; python3 -m pip list 2>/dev/null | grep -i -E "^(trl|megatron|datasets|opentelemetry-sdk|tenacity|pyarrow|accelerate) "' ;;
        tests-ipc) go 150 python3 -m pytest -m gpu tests/test_gpu.py -k cuda_ipc -p no:cacheprovider -q -s ;;
        grpo-110m-ipc) go 120 bash -c 'python3 benchmarks/gpu_grpo.py --micro-batch 256 --steps 6 -- --weights.transport cuda_ipc' ;;
        tests-sharded) go 120 python3 -m pytest -m gpu tests/test_gpu.py -k sharded -p no:cacheprovider -q -s ;;
        tests-kernel) go 120 python3 -m pytest -m gpu tests/test_gpu.py -k "${KTESTS:-decode_kernel}" -p no:cacheprovider -q -s ;;
        tests) go 180 python3 -m pytest -m gpu tests/test_gpu.py -k "not scenario3 and not scenario6 and not megatron" -n 4 -p no:cacheprovider -q -s ;;
        tests-oom) go 200 python3 -m pytest -m gpu tests/test_gpu.py -k "scenario3 or scenario6" -p no:cacheprovider -q -s ;;
        megatron) go 300 python3 -m pytest -m gpu tests/test_gpu.py -k megatron -p no:cacheprovider -q -s ;;
        rollout) go 150 bash -c 'python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 --profile && python3 benchmarks/rollout.py --device cuda --model llama-110m --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3' ;;
        rollout-bf16) go 80 python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 --profile ;;
        rollout-tiles) go 80 bash -c 'for t in ${TILES:-32x4 64x8}; do echo "== RLHF_DECODE_KERNEL_TILE=$t"; RLHF_DECODE_ATTENTION=triton RLHF_DECODE_KERNEL_TILE=$t python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 | grep -E "equal-work|model"; done' ;;
        rollout-attn) go 70 bash -c 'for a in ${ATTN:-sdpa triton}; do echo "== RLHF_DECODE_ATTENTION=$a"; RLHF_DECODE_ATTENTION=$a python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 | grep -E "equal-work|model"; done' ;;
        gloo-probe) go 120 python3 benchmarks/gloo_cuda.py --logs "$OUT/gloo-probe" ;;
        sharded-diag) go 90 bash -c 'for l in fsdp tp2; do echo "== $l"; python3 -m torch.distributed.run --nproc_per_node=2 tests/sharded_steps.py --model tiny-qwen2-gqa --layouts $l --steps 3 --out /tmp/sd-$l.json --device cuda; cat /tmp/sd-$l.json | head -c 1500; done' ;;
        grpo-110m) go 120 python3 benchmarks/gpu_grpo.py --micro-batch 256 --peer trl --steps 6 ;;
        async-110m) go 150 bash -c 'for a in "" "--rollout.mode async --rollout.max_staleness 1"; do echo "== ${a:-sync}"; python3 benchmarks/gpu_grpo.py --micro-batch 256 --steps 5 --warmup 2 -- --weights.transport cuda_ipc $a | grep -E "^[|] |^GRPO|cost"; done' ;;
        async-tiny) go 80 bash -c 'for a in "" "--rollout.mode async --rollout.max_staleness 1"; do echo "== ${a:-sync}"; python3 benchmarks/gpu_grpo.py --tiny --steps 8 -- $a | grep -E "^[|] |^GRPO|cost"; done' ;;
        grpo-tiny) go 80 python3 benchmarks/gpu_grpo.py --tiny --peer trl --steps 8 ;;
        grpo-tiny-heap) go 100 bash -c 'for mb in 4 0; do echo "== runtime.heap_mmap_threshold_mb $mb"; python3 benchmarks/gpu_grpo.py --tiny --steps 8 -- --runtime.heap_mmap_threshold_mb $mb; done' ;;
        sharding-run) go 300 python3 benchmarks/sharding.py --part run --device cuda --model qwen2-1.5b --run-world 2 --run-steps 3 ;;
        sharding-run-tiny) go 100 python3 benchmarks/sharding.py --part run --device cuda --model tiny-qwen2-gqa --run-world 2 --run-steps 3 ;;
        sharding-run1) go 200 python3 benchmarks/sharding.py --part run --device cuda --model qwen2-1.5b --run-world 1 --run-steps 3 ;;
        sharding-layouts) go 240 python3 benchmarks/sharding.py --part layouts --device cuda --model llama-500m --worlds 2 --layouts dp,fsdp,tp,fsdp+tp ;;
        *) echo "part $name: unknown; parts: $ALL async-110m async-tiny tests-ipc grpo-110m-ipc tests-sharded tests-kernel rollout-bf16 rollout-tiles (or remaining, remaining2, remaining3)" | tee -a "$OUT/summary.log"
           return 2 ;;
    esac
}
for p in $PARTS; do
    run "$p"
done
exit 0

#!/usr/bin/env bash
# Every GPU check of the README's "On a GPU" section, in one go, each part under its own time limit; a part that
# fails is reported and the next one runs. Writes one log per part under OUTDIR and prints a summary line per part.
#
#   bash benchmarks/gpu_session.sh OUTDIR [PART ...]
#
# Parts (default: all, in this order): info tests tests-oom megatron rollout rollout-attn gloo-probe sharded-diag grpo-110m
# grpo-tiny grpo-tiny-heap sharding-run sharding-run-tiny sharding-run1 sharding-layouts; asked for by name only:
# tests-sharded (the sharded GPU test alone), tests-kernel (the decode kernel's GPU test), rollout-bf16 (the bf16 rollout
# with its profile), rollout-tiles (the Triton decode kernel's tiles, TILES="32x4 64x8 ..."). ATTN="sdpa triton ..."
# picks rollout-attn's decode attentions. KTESTS picks tests-kernel's tests (-k). The peers (trl)
# and megatron-core must be importable (pip install trl megatron-core, or wheels on PYTHONPATH); a part whose package is
# missing says so in its log.
set -u
OUT=${1:?usage: gpu_session.sh OUTDIR [PART ...]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PARTS=${*:-info tests tests-oom megatron rollout rollout-attn gloo-probe sharded-diag grpo-110m grpo-tiny grpo-tiny-heap sharding-run sharding-run-tiny sharding-run1 sharding-layouts}
part() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return ;; esac
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "part $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
}
part info 60 bash -c 'nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; python3 -m pip list 2>/dev/null | grep -i -E "^(trl|megatron|datasets|opentelemetry-sdk|tenacity|pyarrow|accelerate) "'
part tests-sharded 120 python3 -m pytest -m gpu tests/test_gpu.py -k sharded -p no:cacheprovider -q -s
part tests-kernel 120 python3 -m pytest -m gpu tests/test_gpu.py -k "${KTESTS:-decode_kernel}" -p no:cacheprovider -q -s
part tests 180 python3 -m pytest -m gpu tests/test_gpu.py -k "not scenario3 and not scenario6 and not megatron" -n 4 -p no:cacheprovider -q -s
part tests-oom 200 python3 -m pytest -m gpu tests/test_gpu.py -k "scenario3 or scenario6" -p no:cacheprovider -q -s
part megatron 120 python3 -m pytest -m gpu tests/test_gpu.py -k megatron -p no:cacheprovider -q -s
part rollout 150 bash -c 'python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 --profile && python3 benchmarks/rollout.py --device cuda --model llama-110m --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3'
part rollout-bf16 80 python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 --profile
part rollout-tiles 80 bash -c 'for t in ${TILES:-32x4 64x8}; do echo "== RLHF_DECODE_KERNEL_TILE=$t"; RLHF_DECODE_ATTENTION=triton RLHF_DECODE_KERNEL_TILE=$t python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 | grep -E "equal-work|model"; done'
part rollout-attn 70 bash -c 'for a in ${ATTN:-sdpa triton}; do echo "== RLHF_DECODE_ATTENTION=$a"; RLHF_DECODE_ATTENTION=$a python3 benchmarks/rollout.py --device cuda --model llama-110m --dtype bfloat16 --batches 512 --new-tokens 128 --warm-steps 0 --repeats 3 | grep -E "equal-work|model"; done'
part gloo-probe 120 python3 benchmarks/gloo_cuda.py --logs "$OUT/gloo-probe"
part sharded-diag 90 bash -c 'for l in fsdp tp2; do echo "== $l"; python3 -m torch.distributed.run --nproc_per_node=2 tests/sharded_steps.py --model tiny-qwen2-gqa --layouts $l --steps 3 --out /tmp/sd-$l.json --device cuda; cat /tmp/sd-$l.json | head -c 1500; done'
part grpo-110m 120 python3 benchmarks/gpu_grpo.py --micro-batch 256 --peer trl --steps 6
part grpo-tiny 80 python3 benchmarks/gpu_grpo.py --tiny --peer trl --steps 8
part grpo-tiny-heap 100 bash -c 'for mb in 4 0; do echo "== runtime.heap_mmap_threshold_mb $mb"; python3 benchmarks/gpu_grpo.py --tiny --steps 8 -- --runtime.heap_mmap_threshold_mb $mb; done'
part sharding-run 150 python3 benchmarks/sharding.py --part run --device cuda --model qwen2-1.5b --run-world 2 --run-steps 3
part sharding-run-tiny 100 python3 benchmarks/sharding.py --part run --device cuda --model tiny-qwen2-gqa --run-world 2 --run-steps 3
part sharding-run1 200 python3 benchmarks/sharding.py --part run --device cuda --model qwen2-1.5b --run-world 1 --run-steps 3
part sharding-layouts 240 python3 benchmarks/sharding.py --part layouts --device cuda --model llama-500m --worlds 2 --layouts dp,fsdp,tp,fsdp+tp
exit 0

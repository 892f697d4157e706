#!/usr/bin/env bash
# Every GPU check of the harness as one call on a lent H200 (at most ~9 minutes; each part has its own
# time limit, settable): scripts/gpu_check_speed.sh (Triton KL kernel tests, the time table on a
# random-init qwen2.5-0.5b in bf16), then scripts/gpu_check_fsdp2.sh (a 2-step logra fsdp2 job on one
# GPU with nccl, and the CUDA memory script). The outputs come back as one archive, $OUT/gpu_check.tgz
# (the device returns at most 8 files), plus the two logs.
#   here, once:  scripts/gpu_check_fsdp2.sh prepare; copy the SmolLM2 tokenizer cache into .gpu_cache/;
#                download the wheels scripts/gpu_check_speed.sh names into .whl/
#   device call: carry [".whl", ".gpu_cache", ".cache/gpu_check"], command `bash scripts/gpu_check.sh`
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${OUT:-/tmp/gpu_check}; mkdir -p "$ROOT"
export TRITON_TIMEOUT=${TRITON_TIMEOUT:-120} TABLE_TIMEOUT=${TABLE_TIMEOUT:-200} RUN_TIMEOUT=${RUN_TIMEOUT:-150} \
       MEMORY_TIMEOUT=${MEMORY_TIMEOUT:-60} REPEATS=${REPEATS:-2}
OUT=$ROOT/speed bash scripts/gpu_check_speed.sh > "$ROOT/speed.log" 2>&1; speed=$?
[ -d /tmp/site ] && export WHEEL_SITE=/tmp/site  # the wheels gpu_check_speed.sh installed
OUT=$ROOT/fsdp2 bash scripts/gpu_check_fsdp2.sh > "$ROOT/fsdp2.log" 2>&1; fsdp2=$?
echo "speed checks exit $speed, fsdp2 checks exit $fsdp2" | tee -a "$ROOT/speed.log"
tar -czf "$ROOT/gpu_check.tgz" -C "$ROOT" --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.pt' speed fsdp2 2>/dev/null
rm -rf "$ROOT/speed" "$ROOT/fsdp2"
exit $(( speed || fsdp2 ))

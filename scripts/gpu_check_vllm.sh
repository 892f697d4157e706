#!/usr/bin/env bash
# One GPU check of the colocated vLLM engine (docs/distributed.md, "vLLM engine"), a few minutes on one GPU:
# a 3-step logra run under torchrun --nproc_per_node=1 (fsdp2, nccl, bf16, logra.master=stochastic) with
# rollout.engine=vllm: vLLM's external_launcher executor, gpu_memory_utilization and the KV budget from
# the config, CUDA graphs on, weights updated in place through views into vLLM's fused parameters, sleep
# level 1 between rollouts. Passes when every sync is verified without a resync (sync/resyncs == 0) and
# the sampler's log-probs match the trainer's (kl/sampler_trainer). Needs `import vllm` (a CUDA build) on
# the machine; uses scripts/gpu_check_fsdp2.sh's prepared cache (.cache/gpu_check) for the other packages
# and the tokenizer. Everything it writes goes to $OUT (env.txt, run.log, run/).
#
#   scripts/gpu_check_fsdp2.sh prepare   # HERE, once
#   scripts/gpu_check_vllm.sh            # on the GPU machine, with .cache/gpu_check carried along
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=.cache/gpu_check
OUT=${OUT:-/tmp/gpu_check_vllm}
mkdir -p "$OUT"
export PYTHONPATH="${WHEEL_SITE:+$WHEEL_SITE:}$PWD/$CACHE/site:$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
{ nvidia-smi || true; $PY -c "import torch, vllm; print(torch.__version__, vllm.__version__, torch.cuda.get_device_name())"; } \
    > "$OUT/env.txt" 2>&1 || { echo "no vLLM here: $(tail -1 "$OUT/env.txt")"; exit 3; }

# a random-init model of the qwen2.5-0.5b preset's shape, bf16, with the SmolLM2 tokenizer
$PY scripts/check_model.py "$OUT/model" "$CACHE/tokenizer"

rc=0
timeout "${RUN_TIMEOUT:-420}" $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m experiments.train \
    method=logra logra.master=stochastic "model.name=$OUT/model" model.dtype=bfloat16 dist.strategy=fsdp2 \
    dist.backend=nccl task=arith train.steps=3 train.prompts_per_step=4 train.group_size=4 train.micro_batch_size=8 \
    train.skip_zero_advantage=false rollout.engine=vllm rollout.max_new_tokens=64 rollout.vllm.max_num_seqs=16 \
    rollout.vllm.max_model_len=512 rollout.vllm.sleep=1 eval.every=0 logra.rank=64 "out_dir=$OUT/run" \
    > "$OUT/run.log" 2>&1 || rc=$?
echo "vllm run exit code: $rc" | tee -a "$OUT/run.log"
$PY - "$OUT/run/metrics.jsonl" <<'PYEOF' | tee -a "$OUT/run.log" || rc=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "sync/resyncs" in l]
print("steps", len(rows), "resyncs", [r["sync/resyncs"] for r in rows],
      "kl/sampler_trainer", [round(r.get("kl/sampler_trainer", float("nan")), 6) for r in rows])
sys.exit(0 if len(rows) == 3 and all(r["sync/resyncs"] == 0 for r in rows) else 1)
PYEOF
exit $rc

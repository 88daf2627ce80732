#!/usr/bin/env bash
# Every GPU benchmark in one device call, in phases ordered by value, each under its own time
# limit and all under one deadline, results written as they come (a phase cut off keeps the rows
# it finished).
#
#   bash bench/gpu_all.sh OUT_DIR            # on a GPU machine without Ray
#   DRY_RUN=1 bash bench/gpu_all.sh /tmp/x   # the same pipeline with tiny shapes on CPU
#
# Phases (bench/gpu_compare.py unless named; seconds are the caps, DEADLINE_S the whole):
#   main     llama-1b and llama-8b at 40 GiB: rayft as a GPU job runs it (compiled layers and     (MAIN_S 300)
#            head, the compiled plan) against HF Trainer + PEFT + Liger Kernel (use_liger_kernel);
#            20 timed rayft steps per row, 8 HF
#   levers   llama-1b at 40 GiB: compiled layers with the eager head and plan (the default     (LEVERS_S 100)
#            before this run), and cuDNN attention first in SDPA's priority
#   tests    tests/gpu/test_gpu.py's accumulation, compile, resume and FlexAttention oracles on     (TESTS_S 90)
#            CUDA (pytest -m gpu; junit.xml)
#   -- a second call (PHASES="dpo qlora ragged" DEADLINE_S=200):
#   dpo      llama-1b at 40 GiB: rayft's DPO (model.compile auto)                           (DPO_S 60)
#   qlora    llama-8b nf4 at 40 GiB, compiled layers                                         (QLORA_S 90)
#   ragged   llama-1b at 40 GiB: ragged data (seq/8 to seq tokens) padded, and packed with    (RAGGED_S 90)
#            FlexAttention's BlockMask (compile auto)
#   later    hf-best (HF + Liger + torch_compile, a process of its own), b80 (both shapes at 80
#            GiB), main-eager (the first run's eager rows), memory (bench/gpu_memory.py): only
#            when PHASES names them
# PHASES="dpo qlora ragged" runs only those. A phase starts only with at least 30 s before
# DEADLINE_S (default 480: with the wheel install and the machine's start it leaves a second
# call's worth of a 15-minute lease). The first H200 run (bench/results/gpu-2026-12-04-nvidia-h200/)
# ran an earlier set of these phases.
#
# Output: OUT/all.log (nvidia-smi and versions first), one result file per phase in OUT/<phase>/
# -- 8 files at most, the most a device call returns.
#
# The GPU machine has torch, an older transformers and peft, but no pydantic, bitsandbytes,
# liger-kernel and no internet: fetch the wheels with bench/fetch_gpu_wheels.sh (into .whl/,
# git-ignored) and run with carry [".whl"]; they are installed into /tmp/site, first on PYTHONPATH.
set -u
out=${1:?usage: bench/gpu_all.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
t0=$SECONDS
# A dry run checks the pipeline on a CPU shared with other tests: its deadline is not a lease's.
deadline=${DEADLINE_S:-$([ -n "${DRY_RUN:-}" ] && echo 1200 || echo 480)}
log="$out/all.log"
: > "$log"

# The wheels are the GPU machine's (Python 3.12, x86-64); a dry run uses this environment.
if [ -z "${DRY_RUN:-}" ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_all: installing .whl/ failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  command -v nvidia-smi >/dev/null && nvidia-smi
  "$PY" - <<'EOF'
import importlib.util, torch, transformers, peft
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "peft", peft.__version__)
for name in ("pydantic", "bitsandbytes", "liger_kernel", "accelerate", "triton"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(name, "missing")
    else:
        from importlib.metadata import version
        print(name, version(name.replace("_", "-")))
EOF
} 2>&1 | tee -a "$log"

failed=0
# limit CAP_S: the seconds a phase may run, min(CAP_S, time to the deadline).
limit() { local left=$((deadline - (SECONDS - t0))); echo $(($1 < left ? $1 : left)); }
# phase NAME CAP_S CMD...: run CMD under `limit CAP_S`; skipped when that is under 30 s.
phase() {
  local name=$1 limit; limit=$(limit "$2"); shift 2
  case " ${PHASES:-$name} " in *" $name "*) ;; *) echo "== $name: not in PHASES" | tee -a "$log"; return ;; esac
  if [ "$limit" -lt 30 ]; then
    echo "== $name: skipped, $((deadline - (SECONDS - t0))) s to the deadline" | tee -a "$log"
    return
  fi
  echo "== $name (limit ${limit} s, at $((SECONDS - t0)) s)" | tee -a "$log"
  mkdir -p "$out/$name"
  timeout "$limit" "$@" 2>&1 | sed -u "s/^/[$name] /" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" = 0 ] || failed=1
}
# --time-limit-s: no new row (combination) after it; the margin leaves a started row time to end.
# compare NAME CAP_S MARGIN_S ARGS...: a bench/gpu_compare.py phase.
compare() {
  local name=$1 cap=$2 margin=$3 limit; limit=$(limit "$2"); shift 3
  phase "$name" "$cap" "$PY" bench/gpu_compare.py --out "$out/$name" --time-limit-s $((limit > margin ? limit - margin : 1)) "$@"
}

if [ -n "${DRY_RUN:-}" ]; then
  # The whole comparison once (both budgets, the compile and QLoRA rows: what CI checks in full),
  # then the phases that differ in kind; Liger needs Triton on a GPU, so on CPU its rows say so.
  # (hf-compile and rayft-qlora-compile compile for minutes on CPU: GPU phases only.)
  compare main 480 120 --dry-run
  # the GPU oracles' pipeline, one test on CPU (all five take minutes there)
  phase tests 120 env RAYFT_GPU_TESTS_ON_CPU=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
    -k accumulation --junitxml "$out/tests/junit.xml"
  phase memory 180 "$PY" bench/gpu_memory.py --dry-run --out-dir "$out/memory"
  compare dpo 180 60 --dry-run --budgets 0.0021 --loops rayft-dpo --compile-shapes '' --qlora-shapes ''
  compare qlora 180 60 --dry-run --budgets 0.0021 --qlora-only
  compare levers 180 60 --dry-run --budgets 0.0021 --loops rayft-ragged,rayft-ragged-packed,rayft-liger,hf-liger \
    --compile-shapes '' --qlora-shapes ''
else
  none=(--compile-shapes '' --qlora-shapes '')
  compare main "${MAIN_S:-300}" 70 --budgets 40 --loops rayft-compile,hf-liger "${none[@]}"
  compare levers "${LEVERS_S:-100}" 40 --budgets 40 --shapes llama-1b --loops rayft-compile-layers,rayft-cudnn "${none[@]}"
  phase tests "${TESTS_S:-90}" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
    -k "accumulation or compile_auto or resume or flex" --junitxml "$out/tests/junit.xml"
  compare dpo "${DPO_S:-60}" 30 --budgets 40 --shapes llama-1b --loops rayft-dpo "${none[@]}"
  compare qlora "${QLORA_S:-90}" 60 --budgets 40 --shapes llama-8b --loops rayft-qlora-compile "${none[@]}"
  compare ragged "${RAGGED_S:-90}" 40 --budgets 40 --shapes llama-1b --loops rayft-ragged,rayft-ragged-packed-flex \
    "${none[@]}"
  # Not in the default PHASES (name them to run): HF + Liger + torch_compile in a process of its
  # own (on the second H200 run it died with an illegal memory access, which ends the process),
  # the first run's phases and the 80 GiB rows.
  if [ -n "${PHASES:-}" ]; then
    compare hf-best "${HF_BEST_S:-120}" 30 --budgets 40 --loops hf-liger-compile "${none[@]}"
    compare b80 "${B80_S:-200}" 60 --budgets 80 --loops rayft-compile,hf-liger-compile "${none[@]}"
    compare main-eager "${MAIN_S:-200}" 60 --budgets 40 --loops rayft,hf "${none[@]}"
    phase memory "${MEM_S:-45}" "$PY" bench/gpu_memory.py --out-dir "$out/memory" --time-limit-s $((${MEM_S:-45} - 15))
  fi
fi
echo "gpu_all: $((SECONDS - t0)) s; failed phases: $failed; results in $out" | tee -a "$log"
ls -lR "$out"
[ "$failed" = 0 ]

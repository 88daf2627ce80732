#!/usr/bin/env bash
# Fetch into .whl/ (git-ignored) exactly the wheels the GPU machine lacks for bench/gpu_all.sh:
# it has torch 2.11 + CUDA 13, transformers 5.17, peft, accelerate, triton 3.6 and no internet;
# it lacks pydantic (and its needs), bitsandbytes (the QLoRA row) and liger-kernel (the Liger
# rows), and its transformers is older than ours (5.17's checkpointing path loses
# every_n_layers). transformers stays at 5.24.0: 5.25 needs huggingface-hub >= 2.4 (the machine
# has 1.33, which transformers checks at import) and the `kernels` package; peft comes at the
# version the dev install resolved here.
#
#   bash bench/fetch_gpu_wheels.sh        # then: device run, carry [".whl"]
#
# Refuses in one line (exit 2) when a wheel is not found; .whl/ is then left as it was. The set
# is about 60 MB: with the ~2.5 MB tree it fits the 64 MiB a device call may carry.
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
pyver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
pkgs=(
  transformers==5.24.0 "peft==$(pyver peft 0.21.2)"
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 regex==2026.11.19 bitsandbytes==0.50.2 liger-kernel==0.8.5
)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Python 3.12 on x86-64 (the GPU machine's); bitsandbytes' wheel is tagged manylinux_2_24.
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp" "${pkgs[@]}" > "$tmp/pip.log" 2>&1; then
  echo "fetch_gpu_wheels: $(grep -m1 -E 'ERROR|No matching' "$tmp/pip.log" || tail -n1 "$tmp/pip.log")" >&2
  exit 2
fi
rm -rf .whl && mkdir .whl && mv "$tmp"/*.whl .whl/
du -sh .whl
ls .whl

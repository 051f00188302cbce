#!/usr/bin/env bash
# Download (here, online) the wheels an offline CUDA machine lacks to run the GPU kit, and trim bitsandbytes
# to its CUDA-13 library; print the total size. The versions are this project's venv's.
#
#   benchmarks/gpu/wheels.sh [--unsloth] [DIR]        (DIR defaults to .whl, ignored by git)
#
# The target machine (Python 3.12) already has what image_packages.txt lists (torch 2.11 with CUDA 13,
# accelerate, safetensors, tokenizers, huggingface_hub, numpy, pandas, pyarrow, psutil, matplotlib, pyyaml, rich,
# xxhash, fsspec, ...): those are NOT fetched. tests/test_gpu_kit.py checks that every need of the project and
# of these wheels is met by one or the other, and that these pins are the versions the project is tested with.
# transformers and peft are, although the machine has them: its transformers 5.17 lacks the
# activation_checkpointing API this project uses (TrainingArguments.activation_checkpointing and
# PreTrainedModel.activation_checkpointing_enable arrived after 5.17), so the versions this project is tested
# with go first on PYTHONPATH (run.sh); their own needs (hub >= 1.31, tokenizers 0.23) are met there.
# --unsloth also fetches unsloth and unsloth_zoo for stage d (their own dependencies are not resolved).
set -euo pipefail

UNSLOTH=0
if [[ "${1:-}" == "--unsloth" ]]; then UNSLOTH=1; shift; fi
DIR="${1:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"

# What the GPU image lacks (or has too old), by name: the versions are the lock's (finetune/constraints.txt),
# the ones the suite passed on; tests/test_gpu_kit.py checks that each name is in the lock.
CARRIED=(
  bitsandbytes   # trimmed below
  transformers peft
  trl datasets dill multiprocess
  pydantic pydantic-core annotated-types typing-inspection
  apollo-torch galore-torch gguf
  kernels tomlkit huggingface-hub httpx2 httpcore2 truststore   # transformers 5.25: kernels, hub >= 2.4 (image: 1.33)
  liger-kernel   # memory.kernels: liger (the cuda extra; triton comes with the image's torch)
)
LOCK="$(dirname "$0")/../../finetune/constraints.txt"
PACKAGES=()
for name in "${CARRIED[@]}"; do
  pin=$(grep -m1 -i "^${name}==" "$LOCK") || { echo "error: $name is not in $LOCK" >&2; exit 1; }
  PACKAGES+=("$pin")
done
if [[ $UNSLOTH == 1 ]]; then PACKAGES+=(unsloth==2026.10.9 unsloth_zoo==2026.10.9); fi

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" "${PACKAGES[@]}"

# bitsandbytes ships one native library per CUDA/ROCm/XPU version (43 MB); keep the CUDA 13.0 and CPU ones.
"$PY" "$(dirname "$0")/trim_wheel.py" "$DIR" bitsandbytes 'libbitsandbytes_(?!cpu\.so|cuda130\.so)' 1cu130

ls -l "$DIR"
wheels=$(cat "$DIR"/*.whl | wc -c)
ROOT="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
tree=$(cd "$ROOT" && git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
LIMIT_MIB=64  # what a call carries: the working tree and the carried paths together
echo "wheels: $((wheels / 1048576)) MiB; with the repository's tracked files: $(((wheels + tree) / 1048576)) MiB (limit $LIMIT_MIB MiB)"
if (( wheels + tree > LIMIT_MIB * 1048576 )); then
  echo "error: the wheels and the tracked files exceed the $LIMIT_MIB MiB a call carries: trim a wheel (trim_wheel.py) or carry fewer" >&2
  exit 1
fi

#!/usr/bin/env bash
# Run the GPU suite: install the carried wheels (if any) into a temporary site folder, offline, then measure.
#
#   benchmarks/gpu/run.sh [--cpu] OUT_DIR [suite options: --first-lease | --stage env,a,b --budgets 8,12 --time-limit 540]
#
# --first-lease: the decisive rows in one call (benchmarks/gpu/first_lease.py): the plan is printed with each
# row's estimated H100 seconds and refused over 420 s of work; with --cpu it is the CPU dry run of that call.
# OUT_DIR/results.md and results.json are rewritten after every row; calling again with an OUT_DIR that holds a
# results.json goes on where it stopped (docs/gpu.md gives the calls for a 15-minute lease).
# WHEELS (default .whl at the repository root) is the folder benchmarks/gpu/wheels.sh filled.
set -euo pipefail
T0=$(date +%s)  # the suite's time limit counts from here: the wheels' install is part of the call

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
CPU=()
if [[ "${1:-}" == "--cpu" ]]; then CPU=(--cpu); shift; fi
if [[ $# -lt 1 ]]; then echo "usage: benchmarks/gpu/run.sh [--cpu] OUT_DIR [suite options]" >&2; exit 2; fi
OUT="$(realpath -m "$1")"; shift
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$REPO/.whl}"

# Installed once per machine: a later call on the same (warm) machine with the same wheels reuses the folder.
SITE=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  STAMP="$(cd "$WHEELS" && ls -l -- *.whl | md5sum | cut -c1-12)"
  SITE="/tmp/finetune-site-$STAMP"
  if [[ ! -f "$SITE/.installed" ]]; then
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    touch "$SITE/.installed"
  fi
fi
export PYTHONPATH="$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export FINETUNE_CACHE="${FINETUNE_CACHE:-$(mktemp -d /tmp/finetune-cache.XXXXXX)}"
cd "$REPO"
# Preflight: every package the suite imports, with its version and where it comes from (the carried wheels
# or the machine), so a missing or clashing package shows here and not in the middle of a stage.
"$PY" - <<'PY'
import importlib, importlib.metadata as md
for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "pydantic",
             "typing_extensions", "tokenizers", "huggingface_hub", "apollo_torch", "galore_torch", "gguf"):
    module = importlib.import_module(name)
    dist = {"apollo_torch": "apollo-torch", "galore_torch": "galore-torch"}.get(name, name)
    print(f"{name:18s} {md.version(dist):14s} {module.__file__}")
import torch
print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
"$PY" -m benchmarks.gpu.suite "$OUT" "${CPU[@]}" --started-at "$T0" "$@"

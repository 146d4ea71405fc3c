#!/usr/bin/env bash
# GPU smoke test of the CUDA runtime image (scripts/build-images.sh without --variant cpu), for
# a machine with an NVIDIA GPU and docker (NVIDIA container toolkit) or podman (CDI). It does
# on a GPU what tests/images does for the CPU variant: as UID 10001, with a read-only root and
# /tmp, /cache and /models as scratch mounts (as the operator's pod spec runs it), the image
# writes a tiny model, serves it on CUDA with the Triton attention backend (Triton compiles its
# launcher with the image's gcc at the first request) and answers one completion.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/gpu-smoke.sh [--engine docker|podman] [--port PORT] [IMAGE]

IMAGE defaults to operator/api/schema.py's DEFAULT_IMAGE (what scripts/build-images.sh tags).
Prints the device torch sees and the completion; exits non-zero if anything fails.
EOF
}

die() { echo "gpu-smoke: $*" >&2; exit 2; }

engine="" port=18000 image=""
while (( $# )); do
  case "$1" in
    --engine) engine=${2:?--engine needs a value}; shift 2 ;;
    --port) port=${2:?--port needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) usage >&2; die "unknown option: $1" ;;
    *) image=$1; shift ;;
  esac
done
[[ -n $image ]] || image=$(sed -n 's/^DEFAULT_IMAGE = "\(.*\)"$/\1/p' operator/api/schema.py)
if [[ -z $engine ]]; then
  for candidate in docker podman; do
    if command -v "$candidate" >/dev/null; then engine=$candidate; break; fi
  done
fi
case "$engine" in
  docker) gpus=(--gpus all) ;;
  podman) gpus=(--device nvidia.com/gpu=all) ;;
  *) die "needs docker or podman (--engine)" ;;
esac
command -v curl >/dev/null || die "needs curl"

name=tokenlane-gpu-smoke-$$
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# tmpfs mounts are noexec by default; Triton loads the launcher it compiles from its cache.
scratch=rw,exec,nosuid,mode=1777
"$engine" run -d --name "$name" "${gpus[@]}" \
  --read-only --user 10001:10001 --cap-drop ALL --security-opt no-new-privileges \
  --tmpfs "/tmp:$scratch,size=2g" --tmpfs "/cache:$scratch,size=4g" --tmpfs "/models:$scratch,size=1g" \
  --shm-size 1g \
  -e HOME=/tmp -e XDG_CACHE_HOME=/cache -e HF_HOME=/cache/huggingface -e HF_HUB_OFFLINE=1 \
  -e TRITON_CACHE_DIR=/cache/triton \
  -p "127.0.0.1:$port:8000" \
  --entrypoint sh "$image" -c '
    set -e
    tokenlane make-tiny-model /models/tiny-llama --arch llama
    exec tokenlane serve --model /models/tiny-llama --served-model-name tiny \
      --device cuda --attention-backend triton --host 0.0.0.0 --port 8000' >/dev/null

echo "gpu-smoke: waiting for $image to become ready (up to 10 minutes)" >&2
for _ in $(seq 600); do
  if curl -fs "http://127.0.0.1:$port/ready" >/dev/null; then break; fi
  if [[ $("$engine" inspect -f '{{.State.Running}}' "$name") != true ]]; then
    "$engine" logs "$name" >&2; die "the runtime exited"
  fi
  sleep 1
done
curl -fs "http://127.0.0.1:$port/ready" >/dev/null || { "$engine" logs "$name" >&2; die "not ready after 10 minutes"; }

"$engine" exec "$name" python -c \
  "import torch; assert torch.cuda.is_available(), 'no CUDA device in the container'; print('gpu-smoke: torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
completion=$(curl -fsS "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
  -d '{"model": "tiny", "prompt": "The images are built, then", "max_tokens": 8, "temperature": 0}')
echo "gpu-smoke: completion $completion"
grep -q '"completion_tokens":8' <<<"${completion// /}" || { "$engine" logs "$name" >&2; die "unexpected completion"; }
echo "gpu-smoke: ok" >&2

#!/usr/bin/env bash
# Builds the two images the manifests run: the runtime (ModelService.spec.image's default,
# from operator/api/schema.py) and the operator (manifests/base/operator-deployment.yaml), from
# manifests/images/*.Dockerfile, with docker, podman or buildah.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/build-images.sh [options] [runtime] [operator]

Builds both images (or the ones named) from manifests/images/, tagged as the manifests expect:
the runtime as operator/api/schema.py's DEFAULT_IMAGE, the operator as the image in
manifests/base/operator-deployment.yaml.

options:
  --engine docker|podman|buildah
                     the builder (default: docker if its daemon answers, else podman, else buildah)
  --variant cuda|cpu the runtime's flavour (default cuda). cpu: a Debian base, torch's CPU
                     build (from --wheels when it holds one, else download.pytorch.org/whl/cpu)
                     and no triton; for kind, minikube and machines without a GPU
  --base IMAGE       the base image of both images (sets CUDA_IMAGE and BASE_IMAGE); it needs
                     apt and a python3 that torch has wheels for
  --debian-base      build a Debian base with debootstrap from this machine's apt mirror
                     (read from /etc/apt/sources.list*; cached, see below), import it into the
                     engine as localhost/tokenlane-debian:SUITE and use it as --base. For
                     machines that reach no image registry. Needs root and debootstrap.
  --wheels DIR       a folder of wheels pip may use (--find-links), mounted read-only into the
                     torch install step as the build context `wheels`. Default for --variant
                     cpu: this machine's pip find-links (PIP_FIND_LINKS or `pip config`)
  --host-pip         pip in the builds uses this machine's pip settings (PIP_* variables
                     first, then `pip config`): http(s) index-url and extra-index-url as build
                     arguments, its cert (a proxy's CA bundle, say) as the build secret
                     pip-cert, its first local find-links folder as --wheels. All are mounted
                     only while pip runs: nothing of them stays in the images
  --runtime-tag T    tag of the runtime image (default: operator/api/schema.py's DEFAULT_IMAGE)
  --operator-tag T   tag of the operator image (default: the operator Deployment's image)
  --build-arg K=V    passed to both builds, after the script's own (so it wins); repeatable.
                     The Dockerfiles' arguments: CUDA_IMAGE, TORCH_VERSION, TORCH_INDEX_URL,
                     EXTRAS (runtime); BASE_IMAGE (operator); VERSION, REVISION (both, labels)
  --dry-run          print the build commands instead of running them (no engine needed)
  -h, --help         this text

environment:
  TOKENLANE_IMAGES_CACHE  where --debian-base keeps its root filesystem tarball
                          (default ${XDG_CACHE_HOME:-~/.cache}/tokenlane-images); delete the
                          tarball, and the localhost/tokenlane-debian image, to rebuild it
  DEBIAN_SUITE            the suite --debian-base bootstraps (default bookworm: python3.11,
                          like the pinned debian:bookworm-slim)
  BUILDAH_ISOLATION       buildah/podman RUN isolation (default here: chroot, which needs no
                          cgroup-capable OCI runtime; set oci to use crun or runc)

examples:
  scripts/build-images.sh                                   # CUDA runtime + operator
  scripts/build-images.sh --variant cpu                     # CPU runtime + operator
  scripts/build-images.sh --engine buildah --variant cpu --debian-base   # no registry at hand
EOF
}

die() { echo "build-images: $*" >&2; exit 2; }

engine="" variant=cuda base="" debian_base=0 wheels="" wheels_given=0 host_pip=0 dry_run=0
runtime_tag="" operator_tag="" extra_args=() targets=()
while (( $# )); do
  case "$1" in
    --engine) engine=${2:?--engine needs a value}; shift 2 ;;
    --variant) variant=${2:?--variant needs a value}; shift 2 ;;
    --base) base=${2:?--base needs an image}; shift 2 ;;
    --debian-base) debian_base=1; shift ;;
    --wheels) wheels=${2:?--wheels needs a folder}; wheels_given=1; shift 2 ;;
    --host-pip) host_pip=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --runtime-tag) runtime_tag=${2:?--runtime-tag needs a value}; shift 2 ;;
    --operator-tag) operator_tag=${2:?--operator-tag needs a value}; shift 2 ;;
    --build-arg) [[ ${2:-} == *=* ]] || die "--build-arg needs KEY=VALUE"; extra_args+=(--build-arg "$2"); shift 2 ;;
    --build-arg=*) extra_args+=(--build-arg "${1#--build-arg=}"); shift ;;
    -h|--help) usage; exit 0 ;;
    runtime|operator) targets+=("$1"); shift ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
(( ${#targets[@]} )) || targets=(runtime operator)
[[ $variant == cuda || $variant == cpu ]] || die "--variant must be cuda or cpu, not $variant"

if [[ -z $engine ]]; then
  for candidate in docker podman buildah; do
    command -v "$candidate" >/dev/null || continue
    # A docker CLI without a reachable daemon cannot build: try the next engine.
    if [[ $candidate == docker ]] && ! docker info >/dev/null 2>&1; then
      echo "build-images: docker is on PATH but its daemon does not answer; trying podman, buildah" >&2
      continue
    fi
    engine=$candidate; break
  done
  [[ -n $engine ]] || die "no working docker, podman or buildah (Debian: apt-get install buildah)"
fi
case "$engine" in docker|podman|buildah) ;; *) die "--engine must be docker, podman or buildah" ;; esac
(( dry_run )) || command -v "$engine" >/dev/null || die "$engine is not on PATH"

# What the manifests point at, so the tags cannot drift from them.
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
torch_version=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml | head -n1)
[[ -n $runtime_tag ]] || runtime_tag=$(sed -n 's/^DEFAULT_IMAGE = "\(.*\)"$/\1/p' operator/api/schema.py)
[[ -n $operator_tag ]] || operator_tag=$(sed -n 's/^ *image: *\([^ ]*tokenlane-operator[^ ]*\)$/\1/p' manifests/base/operator-deployment.yaml | head -n1)
[[ -n $version && -n $torch_version && -n $runtime_tag && -n $operator_tag ]] \
  || die "could not read the version, the torch pin or the image names from pyproject.toml, operator/api/schema.py and manifests/base"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)

image_exists() {
  case "$engine" in
    docker) docker image inspect "$1" >/dev/null 2>&1 ;;
    podman) podman image exists "$1" ;;
    buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
  esac
}

# The first `deb` mirror in the apt sources (one-line and deb822 formats) that serves $1,
# else the first that is not a security mirror.
apt_mirror() {
  local suite=$1 files=() f
  [[ -f /etc/apt/sources.list ]] && files+=(/etc/apt/sources.list)
  for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] && files+=("$f")
  done
  (( ${#files[@]} )) || return 0
  awk -v suite="$suite" '
    function flush() {
      if (types ~ /(^| )deb( |$)/ && enabled != "no" && uri != "") offer(uri, suites)
      types = ""; uri = ""; suites = ""; enabled = ""
    }
    function offer(u, s,   n, i, parts) {
      n = split(s, parts, " ")
      for (i = 1; i <= n; i++) {
        if (parts[i] == suite && exact == "") exact = u
        if (parts[i] !~ /-security$/ && other == "") other = u
      }
    }
    FNR == 1 { flush(); deb822 = (FILENAME ~ /\.sources$/) }
    /^[ \t]*#/ { next }
    deb822 && /^[ \t]*$/ { flush(); next }
    deb822 {
      key = tolower($1); sub(/:$/, "", key); $1 = ""; sub(/^[ \t]+/, "")
      if (key == "types") types = $0
      else if (key == "uris") { split($0, u, " "); uri = u[1] }
      else if (key == "suites") suites = $0
      else if (key == "enabled") enabled = tolower($0)
      next
    }
    $1 == "deb" {
      i = 2
      if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
      offer($i, $(i + 1))
    }
    END { flush(); print (exact != "" ? exact : other) }
  ' "${files[@]}"
}

# A minimal Debian root filesystem from debootstrap, imported as a local image: the base for
# machines that cannot pull one. The tarball is cached; the import is skipped when the engine
# already holds the image.
debian_base_image() {
  local suite=${DEBIAN_SUITE:-bookworm}
  local image=localhost/tokenlane-debian:$suite
  if (( dry_run )) || image_exists "$image"; then echo "$image"; return; fi
  local cache=${TOKENLANE_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenlane-images}
  local arch tarball
  arch=$(dpkg --print-architecture)
  tarball=$cache/debian-$suite-$arch-minbase.tar
  if [[ ! -s $tarball ]]; then
    command -v debootstrap >/dev/null || die "--debian-base needs debootstrap (apt-get install debootstrap)"
    (( EUID == 0 )) || die "--debian-base runs debootstrap, which needs root"
    local mirror
    mirror=$(apt_mirror "$suite")
    [[ -n $mirror ]] || die "no Debian mirror in /etc/apt/sources.list or /etc/apt/sources.list.d/"
    echo "build-images: debootstrap $suite from $mirror into $tarball" >&2
    mkdir -p "$cache"
    local rootfs=$cache/rootfs-$suite.partial
    rm -rf "$rootfs"
    debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >&2
    # Package lists and downloaded .debs are apt's caches, not part of the base.
    tar --numeric-owner -C "$rootfs" --exclude='./var/lib/apt/lists/*' \
      --exclude='./var/cache/apt/*' -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    rm -rf "$rootfs"
  fi
  echo "build-images: importing $tarball as $image" >&2
  local path_env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  case "$engine" in
    docker|podman) "$engine" import --change "ENV $path_env" "$tarball" "$image" >/dev/null ;;
    buildah)
      local ctr
      ctr=$(buildah from scratch)
      buildah add "$ctr" "$tarball" / >/dev/null
      # An import carries no config; a Dockerfile's ENV PATH=...:$PATH needs the usual PATH.
      buildah config --env "$path_env" "$ctr"
      buildah commit --rm -q "$ctr" "$image" >/dev/null ;;
  esac
  echo "$image"
}

if (( debian_base )); then
  [[ -z $base ]] || die "--base and --debian-base are exclusive"
  base=$(debian_base_image)
fi

common_args=(--build-arg "VERSION=$version" --build-arg "REVISION=$revision")
runtime_args=() operator_args=()
if [[ -n $base ]]; then
  runtime_args+=(--build-arg "CUDA_IMAGE=$base")
  operator_args+=(--build-arg "BASE_IMAGE=$base")
fi

# This machine's pip settings: PIP_* variables first, then `pip config`.
host_pip_setting() {
  local name
  name=PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")
  echo "${!name:-$(python3 -m pip config get "global.$1" 2>/dev/null || true)}"
}
host_wheels_dir() {
  local link
  for link in $(host_pip_setting find-links); do
    link=${link#file://}
    if [[ -d $link ]]; then echo "$link"; return; fi
  done
}

if (( host_pip )); then
  # Remote indexes as build arguments, the CA bundle as the build secret pip-cert, the first
  # local find-links folder as the wheels context: each is mounted only while pip runs, so none
  # of it stays in an image. file:// indexes are left out (they would need a mount in every step).
  for key in index-url extra-index-url; do
    remote=()
    for url in $(host_pip_setting "$key"); do
      if [[ $url == http://* || $url == https://* ]]; then remote+=("$url"); fi
    done
    if (( ${#remote[@]} )); then
      common_args+=(--build-arg "PIP_$(tr 'a-z-' 'A-Z_' <<<"$key")=${remote[*]}")
    fi
  done
  cert=$(host_pip_setting cert)
  if [[ -n $cert && -f $cert ]]; then common_args+=(--secret "id=pip-cert,src=$cert"); fi
fi
if (( ! wheels_given )) && { (( host_pip )) || [[ $variant == cpu ]]; }; then
  wheels=$(host_wheels_dir)
fi

if [[ $variant == cpu ]]; then
  if [[ -z $base ]]; then
    # The operator's pinned Debian base (python3.11), so both images share it.
    debian=$(sed -n 's/^ARG BASE_IMAGE=\(.*\)$/\1/p' manifests/images/operator.Dockerfile)
    runtime_args+=(--build-arg "CUDA_IMAGE=$debian")
  fi
  # A local CPU wheel (2.13.0+cpu) outranks PyPI's 2.13.0, so PyPI serves only torch's
  # dependencies; without one, the CPU index serves torch.
  index=https://download.pytorch.org/whl/cpu
  if [[ -n $wheels ]] && compgen -G "$wheels/torch-${torch_version}+cpu-*.whl" >/dev/null; then
    index=https://pypi.org/simple
  fi
  runtime_args+=(--build-arg "TORCH_INDEX_URL=$index" --build-arg EXTRAS=runtime)
fi
if [[ -n $wheels ]]; then
  [[ -d $wheels ]] || die "--wheels $wheels is not a folder"
  runtime_args+=(--build-context "wheels=$(cd "$wheels" && pwd)")
fi

build() {
  local dockerfile=$1 tag=$2; shift 2
  local cmd
  case "$engine" in
    docker) cmd=(env DOCKER_BUILDKIT=1 docker build) ;;
    podman) cmd=(podman build --isolation "${BUILDAH_ISOLATION:-chroot}") ;;
    buildah) cmd=(buildah build --isolation "${BUILDAH_ISOLATION:-chroot}") ;;
  esac
  cmd+=(-f "$dockerfile" -t "$tag" "${common_args[@]}" "$@" ${extra_args[@]+"${extra_args[@]}"} .)
  if (( dry_run )); then printf '%q ' "${cmd[@]}"; echo; return; fi
  echo "build-images: $engine: $tag from $dockerfile" >&2
  "${cmd[@]}"
}

for target in "${targets[@]}"; do
  case "$target" in
    runtime) build manifests/images/runtime.Dockerfile "$runtime_tag" ${runtime_args[@]+"${runtime_args[@]}"} ;;
    operator) build manifests/images/operator.Dockerfile "$operator_tag" ${operator_args[@]+"${operator_args[@]}"} ;;
  esac
done
(( dry_run )) || echo "build-images: built ${targets[*]} ($variant): runtime=$runtime_tag operator=$operator_tag" >&2

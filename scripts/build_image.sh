#!/usr/bin/env bash
# Builds the kvroute image (the Dockerfile) on a machine with no container registry: podman, with a Debian
# bookworm base made by debootstrap from the machine's own apt mirror, run with runc.
#   scripts/build_image.sh [TAG [TARGET]]   (default kvroute:dev, the Dockerfile's last target: runtime)
# Installs podman, debootstrap and runc with apt-get when missing. The base (localhost/debian-base:bookworm)
# is made once and kept; podman's layer cache keeps the dependency layer while pyproject.toml is unchanged.
# On a machine with Docker and a registry, `docker build -t kvroute .` builds the same Dockerfile.
set -euo pipefail

tag=${1:-kvroute:dev}
target=${2:-}
suite=bookworm
base=localhost/debian-base:$suite
repo=$(cd "$(dirname "$0")/.." && pwd)
sudo=()
if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
log() { echo "[build_image] $*" >&2; }

install_tools() {
    local missing=()
    command -v podman > /dev/null || missing+=(podman)
    command -v debootstrap > /dev/null || [[ -x /usr/sbin/debootstrap ]] || missing+=(debootstrap)
    command -v runc > /dev/null || [[ -x /usr/sbin/runc ]] || missing+=(runc)
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "apt-get install ${missing[*]}"
        "${sudo[@]}" apt-get update -qq
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null
    fi
}

# crun and podman's default ulimits fail in these sandboxes (setrlimit RLIMIT_NOFILE: not permitted); runc
# with no default ulimits works.
configure_podman() {
    local dropin=/etc/containers/containers.conf.d/50-kvroute.conf
    if [[ ! -f $dropin ]]; then
        "${sudo[@]}" mkdir -p "$(dirname "$dropin")"
        printf '[containers]\ndefault_ulimits = []\n' | "${sudo[@]}" tee "$dropin" > /dev/null
    fi
}

# The first deb URI serving the suite in the machine's apt sources (deb822 .sources or one-line .list).
apt_mirror() {
    local found
    found=$(cat /etc/apt/sources.list.d/*.sources 2> /dev/null | awk -v suite="$suite" '
        /^[[:space:]]*$/ { if (deb && match_suite && uri != "") { print uri; exit } deb = 0; match_suite = 0; uri = ""; next }
        tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
        tolower($1) == "uris:" { uri = $2 }
        tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) match_suite = 1 }
        END { if (deb && match_suite && uri != "") print uri }' | head -1)
    if [[ -z $found ]]; then
        found=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2> /dev/null |
            awk -v suite="$suite" '$1 == "deb" { u = ($2 ~ /^\[/) ? $3 : $2; s = ($2 ~ /^\[/) ? $4 : $3; if (s == suite) { print u; exit } }')
    fi
    echo "${found:-http://deb.debian.org/debian}"
}

rootfs=
remove_rootfs() {
    if [[ -n $rootfs ]]; then "${sudo[@]}" rm -rf "$rootfs" "$rootfs.log"; fi
    rootfs=
}
trap remove_rootfs EXIT

make_base() {
    if "${sudo[@]}" podman image exists "$base"; then
        log "$base is there"
        return
    fi
    local mirror started
    mirror=$(apt_mirror)
    rootfs=$(mktemp -d /var/tmp/kvroute-base.XXXXXX)
    log "debootstrap $suite from $mirror"
    started=$SECONDS
    "${sudo[@]}" debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$suite" "$rootfs" "$mirror" > "$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
    "${sudo[@]}" rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    "${sudo[@]}" tar -C "$rootfs" -c . | "${sudo[@]}" podman import - "$base" > /dev/null
    remove_rootfs
    log "$base made in $((SECONDS - started)) s"
}


# pip inside the build goes where the machine's pip goes: its index, and its CA bundle (a TLS-inspecting
# proxy's) passed as a build secret, in no layer.
pip_setting() {
    local value=${!1:-}
    [[ -n $value ]] || value=$(python3 -m pip config get "global.$2" 2> /dev/null || true)
    echo "$value"
}

build() {
    local args=(--runtime runc --network host --build-arg "BASE_IMAGE=$base" -t "$tag" -f "$repo/Dockerfile")
    local index cert started
    if [[ -n $target ]]; then args+=(--target "$target"); fi
    index=$(pip_setting PIP_INDEX_URL index-url)
    if [[ $index == http://* || $index == https://* ]]; then args+=(--build-arg "PIP_INDEX_URL=$index"); fi
    cert=$(pip_setting PIP_CERT cert)
    if [[ -n $cert && -s $cert ]]; then args+=(--secret "id=pip_cert,src=$cert"); fi
    log "podman build -t $tag${target:+ --target $target}"
    started=$SECONDS
    "${sudo[@]}" podman build "${args[@]}" "$repo"
    log "$tag built in $((SECONDS - started)) s"
}

install_tools
configure_podman
make_base
build

#!/usr/bin/env bash
# Makes the base image for deploy/container/Containerfile from Debian packages (no image
# registry needed) and prints its podman name on stdout. Needs root, podman and mmdebstrap
# (scripts/system-deps.sh installs both) and a Debian mirror.
#
# The base is the smallest rootfs kvpool's venv runs on: mmdebstrap's `essential` variant (no
# apt) plus python3, python3-venv (ensurepip, for the build stage) and libstdc++6 (numpy's
# wheels link it; minbase gets it through apt), without docs, man pages and locales.
# Cached, keyed by that recipe: the podman image localhost/kvpool-base:<suite>-<key>, and the
# rootfs tarball under $KVPOOL_IMAGE_CACHE/images (default ~/.cache/kvpool), which re-imports it in
# seconds after a `podman rmi -a`. Delete the tarball to take newer Debian packages.
#
# Exit status: 0 and the image name; 3 when the mirror cannot be reached (the caller may skip
# what needed the image); anything else is a failure, with mmdebstrap's output on stderr.
set -euo pipefail

SUITE=${KVPOOL_BASE_SUITE:-bookworm}
MIRROR=${KVPOOL_BASE_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,libstdc++6
RECIPE=(--variant=essential "--include=$PACKAGES"
        --dpkgopt='path-exclude=/usr/share/man/*'
        --dpkgopt='path-exclude=/usr/share/doc/*'
        --dpkgopt='path-include=/usr/share/doc/*/copyright'
        --dpkgopt='path-exclude=/usr/share/locale/*'
        --dpkgopt='path-exclude=/usr/share/info/*')
key=$(printf '%s\n' "${RECIPE[@]}" "$SUITE" "$MIRROR" | sha256sum | cut -c1-12)
image=localhost/kvpool-base:$SUITE-$key
cache=${KVPOOL_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool}
tarball=$cache/images/base-$SUITE-$key.tar

if podman image exists "$image"; then
    echo "$image"
    exit 0
fi

if [ ! -s "$tarball" ]; then
    if ! python3 - "$MIRROR/dists/$SUITE/InRelease" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="HEAD"), timeout=15)
except Exception as exc:
    sys.exit(f"image-base: Debian mirror not reachable: {sys.argv[1]}: {exc}")
EOF
    then
        exit 3
    fi
    mkdir -p "$cache/images"
    # The rootfs is built in a temporary directory: on tmpfs when /dev/shm has room (dpkg's
    # many small writes are several times slower on a busy disk).
    tmp=${TMPDIR:-/tmp}
    if [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR==2 {print $4}')" -gt 1048576 ]; then
        tmp=/dev/shm
    fi
    echo "image-base: mmdebstrap ${RECIPE[*]} $SUITE -> $tarball" >&2
    TMPDIR=$tmp mmdebstrap --quiet --format=tar "${RECIPE[@]}" "$SUITE" "$tarball.part" \
        "$MIRROR" >&2
    mv "$tarball.part" "$tarball"
fi

podman import --quiet "$tarball" "$image" >/dev/null
echo "$image"

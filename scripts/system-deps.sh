#!/usr/bin/env bash
# Installs the system services kvpool's tests run on 127.0.0.1: etcd (membership),
# redis-server (a peer in benchmarks) and prometheus (scrapes a live node in the metrics
# test), and as root podman and mmdebstrap (tests/test_containerfile.py builds the container
# image on a base made from Debian packages: scripts/image-base.sh; without root it skips).
# Idempotent: does nothing when the binaries are already on PATH.
# The packages' own system services are never left running: tests start private instances
# on free ports with their own data dirs, and a system etcd on :2379 would only get in the way.
set -euo pipefail

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
else
    SUDO=(sudo)
fi

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
image_tools=()
if [ "$(id -u)" -eq 0 ]; then
    # podman pulls in crun, conmon and the containers config; as root it needs no uidmap,
    # fuse-overlayfs or slirp4netns (the test builds with chroot isolation, no network setup).
    image_tools=(podman mmdebstrap)
    command -v podman >/dev/null 2>&1 || need+=(podman)
    command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
fi

if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi

echo "system-deps: installing ${need[*]}" >&2

# Keep maintainer scripts from starting services: policy-rc.d exit 101 = "action forbidden".
# Only add it when none exists, and always remove the one we added.
policy=/usr/sbin/policy-rc.d
added_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
    "${SUDO[@]}" chmod 755 "$policy"
    added_policy=1
fi
cleanup() {
    if [ "$added_policy" -eq 1 ]; then
        "${SUDO[@]}" rm -f "$policy"
    fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${need[@]}" >/dev/null

# Belt and braces: if a service got started anyway (no policy-rc.d honoured, systemd), stop it.
for svc in etcd redis-server prometheus; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null; then
        "${SUDO[@]}" systemctl stop "$svc" || true
        "${SUDO[@]}" systemctl disable "$svc" >/dev/null 2>&1 || true
    elif command -v service >/dev/null 2>&1; then
        "${SUDO[@]}" service "$svc" stop >/dev/null 2>&1 || true
    fi
done

for bin in etcd redis-server prometheus "${image_tools[@]}"; do
    command -v "$bin" >/dev/null 2>&1 || { echo "system-deps: $bin still missing" >&2; exit 1; }
done

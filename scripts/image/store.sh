#!/usr/bin/env bash
# `store.sh buildah|podman ARGS...`: buildah or podman on the project's own image store,
# .image/ at the repository root (git-ignored), so that the image scripts, the image tests
# and whoever pushes the image all see the same images (`scripts/image/store.sh buildah
# images` lists them). The settings are the ones that work on a machine with no container
# engine, no overlay mounts and cgroups in hybrid mode: vfs storage; buildah with chroot
# isolation; podman with runc and plain cgroupfs (crun, the default runtime of both,
# refuses hybrid cgroups).
set -euo pipefail
store="$(cd "$(dirname "$0")/../.." && pwd)/.image"
flags=(--root "$store/storage" --runroot "$store/run" --storage-driver vfs)
case "${1:-}" in
  buildah) shift; BUILDAH_ISOLATION=chroot exec buildah "${flags[@]}" "$@" ;;
  podman) shift; exec podman "${flags[@]}" --runtime runc --cgroup-manager cgroupfs "$@" ;;
  *) echo "usage: $0 buildah|podman ARGS..." >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The base image for `make image` where no registry is reachable: Debian bookworm (its
# python3 is 3.11) made with mmdebstrap from Debian's own packages, then turned into an
# image with buildah. Made once and kept in .image/: the tarball and the image are named
# after a hash of this file, so a changed recipe makes a new base and an unchanged one is
# reused. Prints the image's name on stdout.
#
# What is in it, as in python:3.11-slim: Debian's Essential packages, python3,
# python3-venv (ensurepip, so that both of the Containerfile's stages can make a venv
# with pip), ca-certificates and libstdc++6 (grpcio's extension needs it); no apt, no
# documentation but the copyright files, no locales, no device nodes (a runtime gives
# the container its /dev).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
store="$(cd "$here/../.." && pwd)/.image"
buildah=("$here/store.sh" buildah)
key="$(sha256sum "$0" | cut -c1-12)"
name="localhost/grpc-model-gateway-base:bookworm-$key"
rootfs="$store/base-bookworm-$key.tar"

if "${buildah[@]}" inspect --type image "$name" >/dev/null 2>&1; then
  echo "$name"
  exit 0
fi

mkdir -p "$store"
if [ ! -f "$rootfs" ]; then
  rm -f "$store"/base-bookworm-*.tar  # an older recipe's
  echo "base: mmdebstrap bookworm -> $rootfs" >&2
  mmdebstrap --variant=essential --include=python3,python3-venv,ca-certificates,libstdc++6 \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --skip=output/dev \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --format=tar bookworm "$rootfs.part" >&2
  mv "$rootfs.part" "$rootfs"
fi

echo "base: $rootfs -> $name" >&2
container="$("${buildah[@]}" from scratch)"
trap '"${buildah[@]}" rm "$container" >/dev/null' EXIT
"${buildah[@]}" add "$container" "$rootfs" / >&2
"${buildah[@]}" config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 \
  --cmd /bin/sh \
  "$container"
"${buildah[@]}" commit --quiet "$container" "$name" >&2
echo "$name"

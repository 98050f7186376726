#!/usr/bin/env bash
# `build.sh NAME:TAG VERSION`: builds the Containerfile into the project's image store
# (store.sh) with buildah, and prints the image's size. VERSION is pyproject.toml's
# version (the build checks it against the wheel and labels the image with it).
#
# The base is IMAGE_BASE when set (python:3.11-slim, where a registry is reachable), else
# the Debian bookworm base that base.sh makes once from Debian's packages. pip in the
# build reaches PyPI with this machine's CA bundle (PIP_CERT, else the system bundle),
# given to the build as the secret `pip-ca`, so that a TLS-intercepting proxy's CA is
# trusted; it is not kept in the image.
set -euo pipefail
[ "$#" -eq 2 ] || { echo "usage: $0 NAME:TAG VERSION" >&2; exit 2; }
image="$1"
version="$2"
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."

"$here/install-tools.sh" buildah mmdebstrap
base="${IMAGE_BASE:-$("$here/base.sh")}"
ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
secret=()
[ -f "$ca" ] && secret=(--secret "id=pip-ca,src=$ca")
revision="$(git rev-parse HEAD 2>/dev/null || true)"

"$here/store.sh" buildah bud --file Containerfile --tag "$image" "${secret[@]}" \
  --build-arg "BASE=$base" --build-arg "VERSION=$version" --build-arg "REVISION=$revision" .
# The image this tag named before is left untagged: drop it (and anything else untagged).
"$here/store.sh" buildah rmi --prune >/dev/null
"$here/store.sh" buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$image"

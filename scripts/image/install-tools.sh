#!/usr/bin/env bash
# `install-tools.sh COMMAND...`: installs, from Debian's packages, whichever of the named
# commands is missing (buildah, mmdebstrap, podman, runc: each comes in the package of its
# own name). As root it runs apt-get, the way .ci/run installs what the tests need; anyone
# else is told what to install.
set -euo pipefail
missing=()
for command in "$@"; do
  command -v "$command" >/dev/null 2>&1 || missing+=("$command")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing: ${missing[*]}; install them: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"

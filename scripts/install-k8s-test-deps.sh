#!/usr/bin/env bash
# System packages of the Kubernetes integration tests (tests/k8s): Debian's etcd-server (the API
# server's store) and openssl (its keys), plus curl and bc for the node tier's scripts. Idempotent:
# nothing is installed when they are already there. Needs root (CI runs as root) or passwordless sudo.
set -euo pipefail
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
for tool in openssl curl bc; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "install-k8s-test-deps: the Kubernetes tests need: ${missing[*]}; run as root: apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "installing ${missing[*]} (Kubernetes integration tests)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null

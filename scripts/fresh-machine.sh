#!/usr/bin/env bash
# Runs a command of the README in a clean Debian 12 root, as a new user on a fresh machine would:
# mmdebstrap builds the root from Debian's packages with only the toolchain the README names,
# the checkout's committed HEAD is cloned into it, and the command runs there (as root, with
# network to the package registries). Nothing installed on this machine leaks in; only its
# network trust settings are carried over, as any machine on the same network has them: the
# local CA certificates (/usr/local/share/ca-certificates, e.g. of an intercepting proxy) and
# /etc/pip.conf.
#   scripts/fresh-machine.sh ./scripts/demo.sh
#   scripts/fresh-machine.sh ./scripts/test.sh
# Needs root (mmdebstrap, chroot, bind mounts); installs mmdebstrap if missing. The root is
# removed afterwards unless MHA_FRESH_KEEP=1 (its path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: scripts/fresh-machine.sh COMMAND..." >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "fresh-machine: needs root (mmdebstrap, chroot, mounts)" >&2; exit 1; }
if ! command -v mmdebstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
fi
repo=$PWD
dir=$(mktemp -d /tmp/mha-fresh.XXXXXX)
target=$dir/root
cleanup() {
  for p in /proc/[0-9]*; do  # processes still running in the root (an interrupted command)
    [ "$(readlink "$p/root" 2>/dev/null)" = "$target" ] && kill -9 "${p#/proc/}" 2>/dev/null
  done
  for m in dev/pts dev sys proc; do umount -l "$target/$m" 2>/dev/null || true; done
  if [ "${MHA_FRESH_KEEP:-0}" = 1 ]; then echo "fresh-machine: kept $target"; else rm -rf "$dir"; fi
}
trap cleanup EXIT

start=$(date +%s)
mmdebstrap --quiet --variant=apt \
  --include=g++,cmake,make,git,libgtest-dev,libbenchmark-dev,python3,ca-certificates \
  bookworm "$target"
echo "fresh-machine: clean Debian 12 root in $(($(date +%s) - start)) s"
git clone --quiet --no-hardlinks "$repo" "$target/root/mha"
for m in proc sys dev dev/pts; do mkdir -p "$target/$m" && mount --bind "/$m" "$target/$m"; done
cp /etc/resolv.conf "$target/etc/resolv.conf"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$target/usr/local/share/ca-certificates/"
  chroot "$target" update-ca-certificates >/dev/null 2>&1
fi
[ -f /etc/pip.conf ] && cp /etc/pip.conf "$target/etc/pip.conf"
start=$(date +%s)
status=0
# A clean environment: what a login shell on the fresh machine has, plus CI if set.
env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  TERM="${TERM:-dumb}" ${CI:+CI=$CI} ${MHA_TEST_QUICK:+MHA_TEST_QUICK=$MHA_TEST_QUICK} \
  chroot "$target" /bin/bash -c 'cd /root/mha && "$@"' bash "$@" || status=$?
echo "fresh-machine: '$*' exited $status after $(($(date +%s) - start)) s"
exit "$status"

#!/usr/bin/env bash
# Installs Debian packages for the tests (make system-deps), waiting for
# apt's locks instead of failing at once: on a fresh machine something else
# (unattended upgrades, another setup) often holds them for the first
# minutes. dpkg's lock is waited for by apt itself (DPkg::Lock::Timeout);
# the package lists' lock, which `apt-get update` takes, is not, so update is
# retried while another process holds it. Gives up after LOCK_WAIT_S.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: $0 PACKAGE..." >&2; exit 2; }
LOCK_WAIT_S=${LOCK_WAIT_S:-600}
apt=(env DEBIAN_FRONTEND=noninteractive apt-get -qq -o "DPkg::Lock::Timeout=$LOCK_WAIT_S")
deadline=$((SECONDS + LOCK_WAIT_S))
while :; do
  out=$("${apt[@]}" update 2>&1) && break
  if grep -q "Could not get lock" <<<"$out" && [ $SECONDS -lt $deadline ]; then
    [ -n "${said:-}" ] || { echo "[setup] apt's package lists are locked by another process; waiting (up to ${LOCK_WAIT_S} s)"; said=1; }
    sleep 5
    continue
  fi
  echo "$out" >&2
  exit 1
done
out=$("${apt[@]}" install -y "$@" 2>&1) || { echo "$out" >&2; exit 1; }

#!/usr/bin/env bash
# Installs the command-line tools some tests need, from apt, when they are missing:
#   promtool  (package prometheus): tests/deploy/test_prometheus_rules.py
#   chromium  (package chromium):   headless browser checks
# Usage: deploy/ci/install-tools.sh [TOOL ...]   (default: promtool chromium)
# Idempotent: a tool already on PATH is left alone, and apt is not touched when nothing is
# missing. Runs as root, or through sudo when that is available without a password.
set -euo pipefail

declare -A PACKAGE=([promtool]=prometheus [chromium]=chromium)
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(promtool chromium)

missing=()
for tool in "${tools[@]}"; do
  package="${PACKAGE[$tool]:-}"
  if [ -z "$package" ]; then
    echo "install-tools: unknown tool '$tool' (known: ${!PACKAGE[*]})" >&2
    exit 2
  fi
  command -v "$tool" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "install-tools: need root to apt-get install ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-tools: no apt-get here; install ${missing[*]} by hand" >&2
  exit 1
fi

echo "install-tools: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
# --no-install-recommends: prometheus would otherwise pull in exporters and a web UI; only
# promtool is wanted. The package's service is not started in containers (no init system).
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"

#!/usr/bin/env bash
# Install shardc and what it needs on a fresh machine.
#   scripts/setup.sh          the package, the MoE example's Python deps and its Debian data packages
#   scripts/setup.sh --test   the same plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."

extras="moe"
if [[ "${1:-}" == "--test" ]]; then extras="test"; fi

# Parallel text for `python -m moe.translate` comes from Debian packages (public-domain Bibles, and
# German-English example sentences). Without them the example falls back to a synthetic task.
DATA_PACKAGES="sword-text-sparv sword-text-kjv trans-de-en"
missing=""
for p in $DATA_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [[ -n "$missing" ]]; then
  if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian data packages:$missing"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null \
      || echo "setup: could not install$missing; moe.translate will use its synthetic task"
  else
    echo "setup: not root; to get the example's real data run: sudo apt-get install$missing"
  fi
fi

python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

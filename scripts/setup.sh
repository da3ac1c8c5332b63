#!/usr/bin/env bash
# Install shardc and what it needs on a fresh machine.
#   scripts/setup.sh          the package, the MoE example's Python deps and its Debian data packages
#   scripts/setup.sh --test   the same plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."

extras="moe"
if [[ "${1:-}" == "--test" ]]; then extras="test"; fi

# Parallel text for `python -m moe.translate` comes from Debian packages (public-domain Bibles, and
# German-English example sentences); moe/setup-data.sh installs them (as root). Without them the example
# falls back to a synthetic task, and says so.
sh moe/setup-data.sh || echo "setup: continuing without the example's Debian data packages (see above)"

python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

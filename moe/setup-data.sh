#!/bin/sh
# Install the Debian packages the MoE translation example reads its parallel text from:
#   sword-text-sparv  Spanish Reina-Valera 1909 Bible (SWORD module spaRV1909eb, public domain)
#   sword-text-kjv    King James Version (SWORD module engKJV2006eb, public domain)
#   trans-de-en       Ding German-English dictionary with example sentences (GPL-2+), for --corpus trans-de-en
# Usage: sudo sh moe/setup-data.sh        (non-interactive; about 12 MB of .debs)
# scripts/setup.sh runs it; it is the one place that knows these packages. Exits 0 when they are installed.
set -eu
PACKAGES="sword-text-sparv sword-text-kjv trans-de-en"

missing=""
for p in $PACKAGES; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -z "$missing" ] && command -v dpkg >/dev/null 2>&1; then
    echo "moe data packages already installed: $PACKAGES"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        exec sudo -n sh "$0" "$@"
    fi
    echo "moe/setup-data.sh must run as root to install Debian packages. Run:" >&2
    echo "    sudo sh moe/setup-data.sh" >&2
    echo "or, as root:" >&2
    echo "    apt-get update && apt-get install -y $PACKAGES" >&2
    echo "Without them, python -m moe.translate falls back to its synthetic task." >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not found: this script is for Debian/Ubuntu. The example reads the SWORD modules" >&2
    echo "spaRV1909eb and engKJV2006eb from /usr/share/sword or ~/.sword (or \$SWORD_PATH); any" >&2
    echo "installation of them works, or pass your own parallel text with --data pairs.tsv." >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null
echo "Installed: $PACKAGES"
ls -d /usr/share/sword/modules/texts/ztext/spaRV1909eb /usr/share/sword/modules/texts/ztext/engKJV2006eb /usr/share/trans/de-en

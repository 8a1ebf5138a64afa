#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for tests/integration/test_mlflow_ui.py.
# Idempotent: does nothing (fast) when a chromium binary is already on PATH. Needs root for apt;
# without root it only says what to run, and the UI test skips.
set -euo pipefail

for bin in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$bin" >/dev/null 2>&1; then
        echo "install_chromium: $bin already present ($(command -v "$bin"))"
        exit 0
    fi
done

if [ "$(id -u)" != "0" ]; then
    echo "install_chromium: no chromium and not root; run: sudo apt-get install -y --no-install-recommends chromium fonts-dejavu-core" >&2
    echo "install_chromium: the MLflow UI test will be skipped" >&2
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: no apt-get (not Debian/Ubuntu); install Chromium yourself; the UI test will be skipped" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# fonts-dejavu-core: without any font the screenshot's text renders as boxes.
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "install_chromium: installed $(chromium --version 2>/dev/null || echo chromium)"

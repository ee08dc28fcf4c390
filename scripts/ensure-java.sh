#!/usr/bin/env bash
# Make sure a Java 17+ runtime is available for PySpark; install one with the system package manager if not.
set -euo pipefail
version() { java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'; }
if command -v java >/dev/null 2>&1 && [ "$(version)" -ge 17 ] 2>/dev/null; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q openjdk-17-jre-headless >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openjdk-17-jre-headless >/dev/null 2>&1; }
fi
command -v java >/dev/null 2>&1 && [ "$(version)" -ge 17 ]

#!/usr/bin/env bash
# Prepare this machine to run the tests (README command 2, .ci/run): what tuning needs
# (deploy/setup.sh) plus what only the tests use. apt: openssh-server (the deploy tests start their
# own sshd), iproute2 and util-linux (the two-host tests build hosts from network and PID namespaces
# with ip, unshare and nsenter), chromium (a Flower screenshot). The package's extras: dev (pytest,
# its plugins, the MLflow server) and hf (the Hugging Face Trainer example's tests). Idempotent, as
# setup.sh: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
{ command -v unshare && command -v nsenter; } >/dev/null 2>&1 || missing+=(util-linux)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] || bash deploy/apt_install.sh "for the deploy, two-host and Flower tests" "${missing[@]}"

exec bash deploy/setup.sh --extras deepspeed,dev,hf

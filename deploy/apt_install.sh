#!/usr/bin/env bash
# Installs Debian/Ubuntu packages for deploy/setup.sh and deploy/setup_tests.sh, with sudo when not
# root, saying what and why in one line. Usage: apt_install.sh WHY PACKAGE...
set -euo pipefail
why=$1
shift
echo "setup: installing $* (apt, $why)"
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
$sudo_cmd apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$@" >/dev/null

#!/usr/bin/env bash
# A Vulkan device for ManiSkill3: SAPIEN asks for one even when nothing is rendered. On Debian 12 the software driver
# (Mesa's lavapipe) of the release (Mesa 22) lacks VK_KHR_external_semaphore_fd; Mesa 25 from bookworm-backports
# works. Installs it from the Debian mirror that apt already uses (needs root or sudo). Anywhere else: says what is
# needed and leaves the system alone (a machine with a GPU driver has a Vulkan device already).
set -euo pipefail

if [ ! -f /etc/debian_version ] || ! grep -q '^12' /etc/debian_version; then
  echo "vulkan: not Debian 12; ManiSkill3 needs a Vulkan driver (a GPU's, or Mesa >= 25's lavapipe) installed by hand"
  exit 0
fi
have=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
if [[ "$have" =~ ^(2[5-9]|[3-9][0-9])\. ]]; then
  exit 0  # done already
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "vulkan: need root (or sudo) to install mesa-vulkan-drivers" >&2; exit 1; }
  sudo="sudo"
fi
mirror=$(grep -h -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
mirror=${mirror:-$(grep -h -m1 -E '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}')}
mirror=${mirror:-http://deb.debian.org/debian}
echo "vulkan: installing mesa-vulkan-drivers from bookworm-backports ($mirror) for ManiSkill3"
printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
  "$mirror" /usr/share/keyrings/debian-archive-keyring.gpg |
  $sudo tee /etc/apt/sources.list.d/m2flow-backports.sources >/dev/null
$sudo apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends -t bookworm-backports \
  mesa-vulkan-drivers >/dev/null
echo "vulkan: $(dpkg-query -W -f='${Package} ${Version}' mesa-vulkan-drivers)"

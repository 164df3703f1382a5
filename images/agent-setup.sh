#!/bin/sh
# Runs as root inside a chroot of a copy of the base image's tree (images/build.py starts it in a
# private mount namespace with its own /proc). Arguments: UID, user name, home, then the Debian
# packages to install. Whatever this script does is part of the agent image's recipe hash.
set -eu
uid=$1 user=$2 home=$3
shift 3
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 0755 /usr/sbin/policy-rc.d

apt-get update -q -o Acquire::Retries=3
apt-get install -y -q -o Acquire::Retries=3 --no-install-recommends "$@"

groupadd --gid "$uid" "$user"
useradd --uid "$uid" --gid "$uid" --home-dir "$home" --create-home --shell /bin/bash "$user"

# The agent runs arbitrary code: no set-user-ID or set-group-ID program is left for it to exploit
# (no-new-privileges already neuters them at run time; this removes them from the image as well).
find / -xdev -type f -perm /6000 -exec chmod ug-s {} +

apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt/* /var/log/dpkg.log \
  /var/cache/debconf/*-old /usr/sbin/policy-rc.d

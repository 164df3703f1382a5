#!/bin/sh
# Runs as root inside a chroot of a copy of the pristine debootstrap tree (images/build.py starts
# it in a private mount namespace with its own /proc). Argument: the Debian suite. It turns the
# debootstrap output into the base image's tree: security and point-release updates applied, no
# documentation, no apt caches. Whatever this script does is part of the base image's recipe hash.
set -eu
suite=$1
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

# debootstrap wrote one line for the mirror it used; add the same archive's updates and security
# suites, so the image carries the fixes published since the point release.
mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
cat >/etc/apt/sources.list <<LIST
deb $mirror $suite main
deb $mirror $suite-updates main
deb $mirror-security $suite-security main
LIST
echo 'Acquire::Languages "none";' >/etc/apt/apt.conf.d/99-agent-appliance-no-translations

# No service may start inside a chroot at build time.
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 0755 /usr/sbin/policy-rc.d

# No documentation, manual pages or translations, now or from later installs (licences stay).
cat >/etc/dpkg/dpkg.cfg.d/01-agent-appliance-nodoc <<'CFG'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
CFG
find /usr/share/doc -depth -mindepth 1 ! -name copyright ! -type d -delete
find /usr/share/doc -depth -mindepth 1 -type d -empty -delete
rm -rf /usr/share/man/* /usr/share/info/*
find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +

apt-get update -q -o Acquire::Retries=3
apt-get upgrade -y -q -o Acquire::Retries=3 -o Dpkg::Options::=--force-confold

apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt/* /var/log/dpkg.log \
  /var/cache/debconf/*-old /usr/sbin/policy-rc.d

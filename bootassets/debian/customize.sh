#!/bin/sh
# customize.sh ROOT: mmdebstrap's customize hook for the Debian 12 tenant image (bootassets/
# debian.py). Runs as root on the build host with ROOT the finished chroot (proc, sys and dev
# mounted by mmdebstrap). Everything here is configuration; no file comes from anywhere but
# Debian's packages.
set -eu
root=$1
here=$(dirname "$0")

# The root file system is found by its label, on a plain disk and on the RAID1 array the
# deploy agent builds (docs/tenant-os.md): both hold the same ext4 labelled "root".
printf 'LABEL=root\t/\text4\terrors=remount-ro\t0\t1\n' >"$root/etc/fstab"
echo localhost >"$root/etc/hostname"

# cloud-init reads only NoCloud: the seed the deploy agent writes into
# /var/lib/cloud/seed/nocloud, or metald's metadata URL that seed points at (seedfrom).
# No locale module (minbase carries no locales package, so no locale-gen or update-locale):
# the string "false", which cc_locale reads as off; a YAML boolean works the same but fails
# cloud-init's own schema, and every boot then logged "Invalid cloud-config provided".
cat >"$root/etc/cloud/cloud.cfg.d/90-metald.cfg" <<'EOF'
# metald's Debian 12 image: NoCloud only (the deploy agent's seed, or metald's URL)
datasource_list: [NoCloud, None]
locale: "false"
EOF

# The build's SSH host keys would be every machine's: cloud-init makes each machine its own.
rm -f "$root"/etc/ssh/ssh_host_*
# Made on first boot, per machine.
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"

# Kernel modules no server uses (sound, cameras, wireless, bluetooth, consumer GPUs, staging):
# out, then depmod and a new initramfs. NICs (mlx5, InfiniBand), storage, md/dm, bonding and
# 8021q stay.
for kdir in "$root"/lib/modules/*; do
	kver=${kdir##*/}
	for d in sound drivers/media drivers/net/wireless net/wireless net/mac80211 \
		drivers/bluetooth net/bluetooth drivers/staging drivers/gpu/drm/amd \
		drivers/gpu/drm/radeon drivers/gpu/drm/nouveau drivers/gpu/drm/i915 drivers/isdn \
		drivers/iio drivers/input/touchscreen drivers/input/joystick drivers/input/tablet \
		drivers/net/can net/can drivers/net/usb drivers/nfc net/nfc drivers/hwmon/pmbus; do
		rm -rf "${kdir:?}/kernel/$d"
	done
	chroot "$root" depmod -a "$kver"
done

# extlinux boots the image (the build installs it into /boot/extlinux); a new kernel package
# points its configuration at the newest kernel.
mkdir -p "$root/etc/kernel/postinst.d" "$root/boot/extlinux"
cat >"$root/etc/kernel/postinst.d/zz-metald-extlinux" <<'EOF'
#!/bin/sh
# metald's image boots through extlinux: point /boot/extlinux/extlinux.conf at the newest kernel
set -e
conf=/boot/extlinux/extlinux.conf
[ -f "$conf" ] || exit 0
kver=$(ls /boot/vmlinuz-* | sed 's,^/boot/vmlinuz-,,' | sort -V | tail -n 1)
sed -i -e "s,^\(  LINUX \).*,\1/boot/vmlinuz-$kver," -e "s,^\(  INITRD \).*,\1/boot/initrd.img-$kver," "$conf"
EOF
chmod 0755 "$root/etc/kernel/postinst.d/zz-metald-extlinux"

# The join into the tenant's cluster: the node image's agent (bootassets/node/metald-node) in
# its join form, run by metald-join.service once the network is online and cloud-init has
# written /etc/metald/join.json. munged and slurmd are the agent's to start (with the tenant's
# key and configless), not Debian's units'; the key munge's postinst made is the build's, not
# a tenant's.
install -m 0755 "$here/../node/metald-node" "$root/usr/sbin/metald-node"
install -m 0644 "$here/metald-join.service" "$root/etc/systemd/system/metald-join.service"
mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/metald-join.service \
	"$root/etc/systemd/system/multi-user.target.wants/metald-join.service"
rm -f "$root/etc/systemd/system/multi-user.target.wants/munge.service" \
	"$root/etc/systemd/system/multi-user.target.wants/slurmd.service"
rm -f "$root/etc/munge/munge.key"

chroot "$root" update-initramfs -u -k all
# what apt fetched is not part of the image
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
rm -f "$root"/var/log/*.log "$root"/var/log/apt/*

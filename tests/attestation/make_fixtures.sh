#!/bin/sh
# Regenerate tests/attestation/fixtures/ from real parts: swtpm as each machine's TPM (with an
# EK certificate from swtpm_setup's local CA), tpm2-tools for the EK, the AK and the quotes, and
# QEMU + OVMF measured boot for the UEFI event logs. Nothing here is hand-made bytes.
#
#   tests/attestation/make_fixtures.sh KERNEL EFIVARFS_KO [OUT]
#
# KERNEL: a Debian vmlinuz; EFIVARFS_KO: that kernel's efivarfs.ko (both from its
# linux-image .deb: `apt-get download linux-image-6.1.0-NN-amd64`, `dpkg-deb -x`). Needs swtpm, swtpm-tools,
# tpm2-tools, ovmf, qemu-system-x86, busybox-static. Takes about a minute under TCG.
#
# Machine "a" boots twice: boot 1 is its first commissioning (the golden values), then the
# "tenant" reverses its UEFI BootOrder from inside the OS; boot 2 is the wipe boot, whose
# PCR 1 differs. Machine "b" is another machine (its own TPM and AK) booted once.
set -eu
KERNEL=$1
EFIVARFS=$2
OUT=${3:-$(dirname "$0")/fixtures}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/attest-fixtures.XXXXXX)
SWTPM_PID=""
cleanup() {
	[ -n "$SWTPM_PID" ] && kill "$SWTPM_PID" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# ---- the guest: busybox + tpm2-tools with their libraries, an /init that quotes ----
ROOT=$WORK/initrd
mkdir -p "$ROOT/bin" "$ROOT/lib" "$ROOT/lib64" "$ROOT/proc" "$ROOT/sys" "$ROOT/dev" "$ROOT/tmp"
cp /bin/busybox "$ROOT/bin/busybox"
cp /usr/bin/tpm2 "$ROOT/bin/tpm2"
cp "$EFIVARFS" "$ROOT/efivarfs.ko"
for lib in $(ldd /usr/bin/tpm2 | awk '/=>/ {print $3}') /usr/lib/x86_64-linux-gnu/libtss2-tcti-device.so.0; do
	cp -L "$lib" "$ROOT/lib/"
done
cp -L /lib64/ld-linux-x86-64.so.2 "$ROOT/lib64/"
cat > "$ROOT/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin LD_LIBRARY_PATH=/lib TPM2TOOLS_TCTI=device:/dev/tpm0
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
mount -t securityfs securityfs /sys/kernel/security
insmod /efivarfs.ko
mount -t efivarfs efivarfs /sys/firmware/efi/efivars
for w in $(cat /proc/cmdline); do case "$w" in nonce=*) nonce=${w#nonce=} ;; change=*) change=${w#change=} ;; esac; done
cd /tmp
tpm2 quote -Q -c 0x81010002 -l sha256:0,1,2,3,4,5,6,7 -q "$nonce" -m quote.msg -s quote.sig -o quote.pcrs -g sha256 -F values
for f in quote.msg quote.sig quote.pcrs; do echo "=== $f"; base64 "$f"; done
echo "=== eventlog"; base64 /sys/kernel/security/tpm0/binary_bios_measurements
echo "=== end"
if [ "$change" = bootorder ]; then
	# The tenant's change: a new boot option Boot0001 (a copy of Boot0000) put first in
	# BootOrder. Files in efivarfs are attributes (NV|BS|RT) then data, in one write.
	e=/sys/firmware/efi/efivars
	g=8be4df61-93ca-11d2-aa0d-00e098032b8c
	{ printf '\007\000\000\000'; tail -c +5 "$e/Boot0000-$g"; } > /tmp/b1
	{ printf '\007\000\000\000\001\000'; tail -c +5 "$e/BootOrder-$g"; } > /tmp/bo
	chattr -i "$e/BootOrder-$g" 2>/dev/null
	cat /tmp/b1 > "$e/Boot0001-$g" && cat /tmp/bo > "$e/BootOrder-$g" && echo "=== bootorder-changed"
fi
poweroff -f
EOF
chmod +x "$ROOT/init"
(cd "$ROOT" && find . | cpio -o -H newc --quiet | gzip -1) > "$WORK/initrd.gz"

# ---- one swtpm per machine: EK certificate, EK, AK persisted at 0x81010002 ----
stop_swtpm() {
	kill "$SWTPM_PID" 2>/dev/null || true
	wait "$SWTPM_PID" 2>/dev/null || true
	SWTPM_PID=""
}

enroll() { # machine
	m=$1
	d=$WORK/tpm-$m
	mkdir -p "$d"
	swtpm_setup --tpm2 --tpmstate "$d" --create-ek-cert --create-platform-cert \
		--overwrite --pcr-banks sha256 >"$d/setup.log" 2>&1
	port=$((23000 + $(od -An -N1 -tu1 /dev/urandom) * 2))
	swtpm socket --tpm2 --tpmstate dir="$d" --server type=tcp,port=$port,bindaddr=127.0.0.1 \
		--ctrl type=tcp,port=$((port + 1)),bindaddr=127.0.0.1 --flags not-need-init,startup-clear \
		--log file="$d/swtpm.log" &
	SWTPM_PID=$!
	export TPM2TOOLS_TCTI="swtpm:host=127.0.0.1,port=$port"
	i=0
	until tpm2 getcap properties-fixed >/dev/null 2>&1 || [ $i -ge 100 ]; do sleep 0.05; i=$((i + 1)); done
	tpm2 nvread 0x01c00002 -o "$OUT/$m-ek-cert.der"
	tpm2 createek -c "$d/ek.ctx" -G rsa -u "$d/ek.pub"
	# No resource manager between tpm2-tools and swtpm here: free each command's objects.
	tpm2 flushcontext -t
	tpm2 readpublic -c "$d/ek.ctx" -f pem -o "$OUT/$m-ek.pem" >/dev/null
	tpm2 createak -C "$d/ek.ctx" -c "$d/ak.ctx" -G ecc -g sha256 -s ecdsa \
		-u "$OUT/$m-ak.tpmt" -f tpmt -n "$OUT/$m-ak.name" >/dev/null
	tpm2 flushcontext -t
	tpm2 flushcontext -s
	tpm2 readpublic -c "$d/ak.ctx" -f pem -o "$OUT/$m-ak.pem" >/dev/null
	tpm2 evictcontrol -C o -c "$d/ak.ctx" 0x81010002 >/dev/null
	tpm2 shutdown
	unset TPM2TOOLS_TCTI
	stop_swtpm
}

boot() { # machine, boot name, nonce (hex), change
	m=$1
	d=$WORK/tpm-$m
	[ -f "$WORK/vars-$m.fd" ] || cp /usr/share/OVMF/OVMF_VARS_4M.fd "$WORK/vars-$m.fd"
	rm -f "$d/ctrl"
	swtpm socket --tpm2 --tpmstate dir="$d" --ctrl type=unixio,path="$d/ctrl" \
		--log file="$d/swtpm.log" --terminate &
	SWTPM_PID=$!
	i=0
	while [ ! -S "$d/ctrl" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
	timeout 240 qemu-system-x86_64 -machine q35 -m 512 -nographic -no-reboot \
		-drive if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd \
		-drive if=pflash,format=raw,unit=1,file="$WORK/vars-$m.fd" \
		-chardev socket,id=chrtpm,path="$d/ctrl" -tpmdev emulator,id=tpm0,chardev=chrtpm \
		-device tpm-tis,tpmdev=tpm0 -net none \
		-kernel "$KERNEL" -initrd "$WORK/initrd.gz" \
		-append "console=ttyS0 quiet nonce=$3 change=$4" >"$WORK/$m-$2.console" 2>&1
	stop_swtpm
	printf '%s' "$3" >"$OUT/$m-$2.nonce"
	for part in quote.msg quote.sig quote.pcrs eventlog; do
		sed 's/\x1b\[[0-9;=]*[a-zA-Z]//g; s/\r$//' "$WORK/$m-$2.console" | awk -v p="=== $part" '$0 ~ /^=== / {on = ($0 == p); next} on' \
			| tr -d '\r' | base64 -d >"$OUT/$m-$2.$part"
		[ -s "$OUT/$m-$2.$part" ] || { echo "no $part from $m $2" >&2; cat "$WORK/$m-$2.console" >&2; exit 1; }
	done
	if [ "$4" = bootorder ]; then
		grep -q "=== bootorder-changed" "$WORK/$m-$2.console" || { echo "BootOrder unchanged" >&2; exit 1; }
	fi
}

enroll a
enroll b
boot a boot1 "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" bootorder
boot a boot2 "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" none
boot b boot1 "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" none
cp /var/lib/swtpm-localca/issuercert.pem "$OUT/swtpm-localca-issuer.pem"
cp /var/lib/swtpm-localca/swtpm-localca-rootca-cert.pem "$OUT/swtpm-localca-root.pem" 2>/dev/null || true
ls -l "$OUT"

#!/bin/bash
# slurm_controller.sh DIR [ROUNDS]: a tenant control plane (munged + configless slurmctld) for
# the node image's end-to-end tests, run as `ip netns exec NS unshare --mount --uts
# --propagation private bash slurm_controller.sh DIR`: private /etc/munge, /run/munge,
# /var/lib/munge and /var/log/munge, hostname "hub". Waits for node-lab1 to be idle, runs
# `srun hostname` on it, writes DIR/node.state, DIR/srun.out (and DIR/srun.rc). With ROUNDS > 1
# (a node that reboots), round R waits for DIR/go.R, then for node-lab1 to register again (its
# SlurmdStartTime changes) and be idle, and writes DIR/node.state.R, DIR/srun.R.out, .err, .rc.
# Then stays up until killed. NODE names another node than node-lab1, NODE_WAIT_S how long a
# round waits for it (240 s).
set -u
D=$1
ROUNDS=${2:-1}
NODE=${NODE:-node-lab1}
# How long each round waits for the node (seconds); a full OS booting under TCG takes longer.
NODE_WAIT_S=${NODE_WAIT_S:-240}
hostname hub
for d in /etc/munge /run/munge /var/lib/munge /var/log/munge; do
	mkdir -p "$d"
	mount -t tmpfs -o mode=0700 tmpfs "$d"
done
chmod 0755 /run/munge
cp "$D/munge.key" /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
# In the foreground (backgrounded here): a daemonized munged would leave the process group and
# outlive the test.
munged -F --force &
for _ in $(seq 1 100); do [ -S /run/munge/munge.socket.2 ] && break; sleep 0.05; done
[ -S /run/munge/munge.socket.2 ] || exit 1
export SLURM_CONF=$D/slurm.conf
slurmctld -D -f "$SLURM_CONF" >"$D/slurmctld.out" 2>&1 &

node_field() { # node_field NAME: Name=VALUE of $NODE in scontrol show node
	scontrol show node "$NODE" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p"
}

for r in $(seq 1 "$ROUNDS"); do
	sfx=""
	before=""
	if [ "$r" -gt 1 ]; then
		sfx=".$r"
		while [ ! -e "$D/go.$r" ]; do sleep 0.5; done
		before=$(node_field SlurmdStartTime)
	fi
	for _ in $(seq 1 "$NODE_WAIT_S"); do
		state=$(sinfo -h -N -n "$NODE" -o %t 2>/dev/null)
		started=$(node_field SlurmdStartTime)
		case "$state" in idle*) [ "$r" = 1 ] || [ "$started" != "$before" ] && break ;; esac
		sleep 1
	done
	{
		echo "node state: ${state:-none}"
		echo "SlurmdStartTime before: ${before:-none}"
		echo "SlurmdStartTime: ${started:-none}"
		echo "BootTime: $(node_field BootTime)"
	} >"$D/node.state$sfx"
	timeout 60 srun -N1 -w "$NODE" hostname >"$D/srun$sfx.out" 2>"$D/srun$sfx.err"
	echo $? >"$D/srun$sfx.rc"
done
sleep infinity

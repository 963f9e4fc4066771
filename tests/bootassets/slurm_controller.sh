#!/bin/bash
# slurm_controller.sh DIR: a tenant control plane (munged + configless slurmctld) for the node
# image's end-to-end test, run as `ip netns exec NS unshare --mount --uts --propagation private
# bash slurm_controller.sh DIR`: private /etc/munge, /run/munge, /var/lib/munge and
# /var/log/munge, hostname "hub". Waits for node-lab1 to be idle, runs `srun hostname` on it,
# writes DIR/srun.out (and DIR/srun.rc), then stays up until killed.
set -u
D=$1
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
for _ in $(seq 1 240); do
	state=$(sinfo -h -N -n node-lab1 -o %t 2>/dev/null)
	case "$state" in idle*) break ;; esac
	sleep 1
done
echo "node state: ${state:-none}" >"$D/node.state"
timeout 60 srun -N1 -w node-lab1 hostname >"$D/srun.out" 2>"$D/srun.err"
echo $? >"$D/srun.rc"
sleep infinity

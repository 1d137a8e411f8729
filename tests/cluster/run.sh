#!/usr/bin/env bash
# `ray up cluster.yaml` for real on three "hosts" of this machine (make test-cluster).
#
# Each host is a network namespace with its own address on a private bridge (10.77.0.0/24,
# no address in the machine's own namespace), its own PID, mount, UTS and IPC namespaces
# (so `ray stop` on one host sees only its processes), its own home, /tmp and /dev/shm,
# and an sshd on its address for a non-root user with passwordless sudo. `ray up` runs from
# a fourth namespace (10.77.0.2) on a copy of cluster.yaml that names these hosts, then:
# mooncake-ray start, a put on the head and a get on each worker, mooncake-ray status,
# serve run of serve_configs/aggregated.yaml answered over HTTP, ray down.
#
# The hosts share this machine's files: their setup does not apt-get or build (that would
# change this machine); it checks sudo and the Makefile's sysdeps step as the ssh user and
# links ~/mooncake-ray/.venv to this tree's .venv (make build), whose interpreter must be
# one the ssh user can run (the system python3). Root only. Removes all it made on exit.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-$ROOT/.venv}
[ "$(id -u)" = 0 ] || { echo "run.sh: needs root (namespaces, a test user)" >&2; exit 1; }
[ -x "$VENV/bin/ray" ] || { echo "run.sh: no $VENV/bin/ray: make build first" >&2; exit 1; }
for b in sshd rsync sudo; do
  command -v $b >/dev/null || [ -x /usr/sbin/$b ] || { echo "run.sh: $b missing (make test-cluster installs it)" >&2; exit 1; }
done

ID=$(( $$ % 100000 ))
U=mcrtest$ID                         # the ssh user
NET=10.77.0
HOSTS=(10 11 12)                     # host i: $NET.${HOSTS[i]}; i=0 is the head
CTL_IP=$NET.2
BR=mcrbr$ID
NS_CTL=mcr$ID-ctl
W=$(mktemp -d /var/tmp/mcr-cluster.XXXXXX)
chmod 755 "$W"
PIDS=()
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

cleanup() {
  local rc=$?
  set +e
  if [ -n "${UP_DONE:-}" ] && [ -z "${DOWN_DONE:-}" ]; then
    log "cleanup: ray down"; ctl "$VENV/bin/ray" down -y "$W/cluster.yaml" >"$W/down.log" 2>&1
  fi
  # Killing each host's unshare (which blocks SIGTERM) kills its PID namespace's init
  # (sshd, through --kill-child) and so everything in that namespace.
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  for i in "${!HOSTS[@]}"; do ip netns del "mcr$ID-h$i" 2>/dev/null; done
  ip netns del "$NS_CTL" 2>/dev/null
  ip link del "$BR" 2>/dev/null
  rm -f "/etc/sudoers.d/$U"
  # the killed hosts' processes may take a moment to go: -f, not to fail on them
  id "$U" >/dev/null 2>&1 && { userdel -f "$U" 2>/dev/null || { sleep 2; userdel -f "$U"; }; }
  [ -n "${KEEP:-}" ] && echo "kept $W" || rm -rf "$W"
  [ -d "/home/$U" ] && rmdir "/home/$U" 2>/dev/null
  [ -n "${ROOT_MODE:-}" ] && chmod "$ROOT_MODE" "$ROOT"
  log "cleanup done (exit $rc)"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the user: passwordless sudo, one key for every host ------------------------------
useradd -M -d "/home/$U" -s /bin/bash -p '*' "$U"   # no password, not locked: keys only
mkdir -p "/home/$U"                  # mount point of each host's own home
echo "$U ALL=(ALL) NOPASSWD:ALL" >"/etc/sudoers.d/$U"; chmod 440 "/etc/sudoers.d/$U"
ssh-keygen -q -t ed25519 -N '' -f "$W/key"
ssh-keygen -q -t ed25519 -N '' -f "$W/hostkey"
mkdir -p /run/sshd                   # sshd's privilege separation directory

cat >"$W/sshd_config" <<EOF
Port 22
HostKey $W/hostkey
PidFile none
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AllowUsers $U
MaxSessions 64
MaxStartups 64
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
EOF

# --- the network: a bridge with no address here, a namespace per host ------------------
ip link add "$BR" type bridge
ip link set "$BR" up
add_ns() {  # name address
  local ns=$1 ip=$2 v=mcrv$ID$3
  ip netns add "$ns"
  ip link add "$v" type veth peer name "${v}p"
  ip link set "${v}p" netns "$ns"
  ip link set "$v" master "$BR" up
  ip netns exec "$ns" ip link set "${v}p" name eth0
  ip netns exec "$ns" ip addr add "$ip/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  ip netns exec "$ns" ip link set lo up
  # A default route, as a real host has: Ray finds its node address by the route out
  # (a UDP connect, which sends nothing); without one the head says 127.0.0.1. Nothing
  # answers past the bridge, which has no address and forwards nowhere.
  ip netns exec "$ns" ip route add default dev eth0
}
add_ns "$NS_CTL" "$CTL_IP" c
# The venv's interpreter may live under /root (pyenv, uv), which the ssh user cannot enter:
# inside the hosts only, /root becomes an empty tmpfs with that one directory bound back.
PYREAL=$(readlink -f "$VENV/bin/python")
ROOT_FIX=
if [[ $PYREAL == /root/* ]]; then
  top=/root/$(cut -d/ -f3 <<<"$PYREAL")  # e.g. /root/.pyenv
  mkdir -p "$W/rootdir"
  ROOT_FIX="mount --bind /root '$W/rootdir' && mount -t tmpfs -o mode=755 tmpfs /root &&
      mkdir -p '$top' && mount --bind '$W/rootdir/${top#/root/}' '$top' &&"
fi
# Hosts and the driver's side get a /tmp of their own; a checkout under /tmp (a CI clone made
# with mktemp) is bound back at its own path inside each (the venv runs from it).
TMP_PRE= TMP_POST=
if [[ $ROOT == /tmp/* ]]; then
  # mktemp -d makes it 0700: the ssh user must enter it (restored on exit)
  ROOT_MODE=$(stat -c %a "$ROOT")
  chmod a+rx "$ROOT"
  mkdir -p "$W/rootsrc"
  TMP_PRE="mount --bind '$ROOT' '$W/rootsrc' &&"
  TMP_POST="mkdir -p '$ROOT' && mount --bind '$W/rootsrc' '$ROOT' &&"
fi
for i in "${!HOSTS[@]}"; do
  h=$W/h$i
  mkdir -p "$h/home/.ssh" "$h/tmp"
  cp -a /etc/skel/. "$h/home/"
  cp "$W/key.pub" "$h/home/.ssh/authorized_keys"
  chmod 700 "$h/home/.ssh"; chmod 600 "$h/home/.ssh/authorized_keys"
  chown -R "$U:" "$h/home"; chmod 1777 "$h/tmp"
  add_ns "mcr$ID-h$i" "$NET.${HOSTS[i]}" "h$i"
  # The host: new PID namespace (sshd is its init), own mounts, hostname and IPC.
  ip netns exec "mcr$ID-h$i" unshare --pid --fork --kill-child --mount-proc --mount --uts --ipc \
    --propagation private sh -c "
      hostname mcr-h$i && $ROOT_FIX $TMP_PRE
      mount --bind '$h/home' '/home/$U' && mount --bind '$h/tmp' /tmp && $TMP_POST
      mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm &&
      exec /usr/sbin/sshd -D -e -f '$W/sshd_config' -o ListenAddress=$NET.${HOSTS[i]}" \
    >"$W/sshd-h$i.log" 2>&1 &
  PIDS+=($!)
done

# The driver's side: its own namespace, /tmp (ray up's state and ssh control sockets), HOME.
mkdir -p "$W/ctl/tmp" "$W/ctl/home"
ctl() {
  ip netns exec "$NS_CTL" unshare --mount --propagation private sh -c \
    "$TMP_PRE mount --bind '$W/ctl/tmp' /tmp && $TMP_POST cd '$ROOT' && exec env HOME='$W/ctl/home' RAY_UP_enable_autoscaler_v2=0 \"\$@\"" sh "$@"
}
SSH_OPTS=(-i "$W/key" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5)
on() {  # host-index command...: run as the ssh user on that host
  local i=$1; shift
  ctl ssh "${SSH_OPTS[@]}" "$U@$NET.${HOSTS[i]}" "$@"
}
for i in "${!HOSTS[@]}"; do
  for _ in $(seq 50); do on "$i" true 2>/dev/null && break; sleep 0.2; done
  on "$i" 'echo "$(hostname) $(id -un) pid-ns init: $(ps -o comm= -p 1)"'
done
log "hosts up: ${HOSTS[*]/#/$NET.}"

# --- the cluster yaml: cluster.yaml with these hosts, this user, and a setup that builds
# nothing (see the top) -------------------------------------------------------------------
"$VENV/bin/python" - "$ROOT/cluster.yaml" "$W/cluster.yaml" <<EOF
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
c["cluster_name"] = "mcr-test-$ID"
c["provider"]["head_ip"] = "$NET.${HOSTS[0]}"
c["provider"]["worker_ips"] = ["$NET.${HOSTS[1]}", "$NET.${HOSTS[2]}"]
c["auth"] = {"ssh_user": "$U", "ssh_private_key": "$W/key"}
c["file_mounts"] = {"~/mooncake-ray": "$ROOT"}
assert c["rsync_exclude"], "cluster.yaml ships no rsync_exclude"
setup = c["setup_commands"]
assert any("make build" in s for s in setup) and any("sudo" in s for s in setup), setup
c["setup_commands"] = [s for s in setup if "bashrc" in s] + [  # PATH, as shipped
    "sudo -n true",  # the real setup's apt-get runs through sudo
    # the Makefile's sysdeps step, as this user, with the packages present: no root needed
    "d=\$(mktemp -d) && cp ~/mooncake-ray/Makefile \$d && make -C \$d sysdeps && rm -rf \$d",
    # not shipped by file_mounts:
    "test ! -e ~/mooncake-ray/.venv/.built && test ! -e ~/mooncake-ray/build && test ! -e ~/mooncake-ray/.git",
    # stands in for make build: this machine's build of this tree
    "ln -sfn $VENV ~/mooncake-ray/.venv && ~/mooncake-ray/.venv/bin/python -c 'import mooncake_ray._private.native'",
]
yaml.safe_dump(c, open(sys.argv[2], "w"), sort_keys=False)
EOF

# --- ray up ------------------------------------------------------------------------------
log "ray up"
UP_DONE=1
ctl "$VENV/bin/ray" up -y "$W/cluster.yaml" >"$W/up.log" 2>&1 || { tail -40 "$W/up.log"; exit 1; }
log "ray up done; waiting for the two workers"
MCR=mooncake-ray                     # on PATH through cluster.yaml's setup
RX() { ctl "$VENV/bin/ray" exec "$W/cluster.yaml" "$1"; }
n=0
for _ in $(seq 60); do
  n=$(on 0 "~/mooncake-ray/.venv/bin/python -c 'import ray; ray.init(address=\"auto\", logging_level=40); print(sum(1 for n in ray.nodes() if n[\"Alive\"] and n[\"Resources\"].get(\"mooncake_store\")))'" 2>/dev/null | tail -1) || true
  [ "$n" = 2 ] && break
  sleep 3
done
if [ "$n" != 2 ]; then
  echo "workers did not join; head's monitor log:"; on 0 'tail -30 /tmp/ray/session_latest/logs/monitor.log' || true
  exit 1
fi
log "3 nodes, 2 store nodes"

# --- the store ---------------------------------------------------------------------------
log "mooncake-ray start"
RX "$MCR start --config ~/mooncake-ray/store.yaml"

PUT='
import hashlib, ray, mooncake_ray
ray.init(address="auto", logging_level=40, log_to_driver=False)
s = mooncake_ray.connect()
for n in (100, 1 << 20, 8 << 20):
    v = hashlib.sha256(str(n).encode()).digest() * (n // 32 + 1)
    s.put(f"cluster-test/{n}", v[:n])
print("put on", ray.util.get_node_ip_address(), "keys:", s.stats()["keys"])
'
GET='
import hashlib, ray, mooncake_ray
ray.init(address="auto", logging_level=40, log_to_driver=False)
s = mooncake_ray.connect()
for n in (100, 1 << 20, 8 << 20):
    v = hashlib.sha256(str(n).encode()).digest() * (n // 32 + 1)
    assert s.get(f"cluster-test/{n}") == v[:n], n
print("get on", ray.util.get_node_ip_address(), "ok")
'
log "put on the head (ray exec)"
RX "~/mooncake-ray/.venv/bin/python -c '$PUT'"
for i in 1 2; do
  log "get on host $i (ssh $NET.${HOSTS[i]})"
  on "$i" "~/mooncake-ray/.venv/bin/python -c '$GET'"
done
log "mooncake-ray status"
RX "$MCR status"
RX "$MCR status --json" >"$W/status.json"
"$VENV/bin/python" - "$W/status.json" <<'EOF'
import json, sys
t = open(sys.argv[1]).read(); s = json.loads(t[t.index("{"):])
assert len(s["nodes"]) == 2 and s["keys"] == 3, (len(s["nodes"]), s["keys"])
print("status: 2 store nodes, 3 keys")
EOF

# --- serve -------------------------------------------------------------------------------
if [ -z "${NO_SERVE:-}" ]; then
  log "serve run serve_configs/aggregated.yaml"
  RX "cd ~/mooncake-ray && serve run --non-blocking serve_configs/aggregated.yaml" >"$W/serve.log" 2>&1 \
    || { tail -30 "$W/serve.log"; exit 1; }
  ok=
  for _ in $(seq 60); do
    if on 0 "curl -sf -m 20 http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"mooncake-ray/tiny-lm\", \"prompt\": \"hello\", \"max_tokens\": 4}'" >"$W/serve.out" 2>/dev/null; then ok=1; break; fi
    sleep 3
  done
  [ -n "$ok" ] || { echo "serve: no answer"; tail -30 "$W/serve.log"; exit 1; }
  log "serve answered: $(head -c 300 "$W/serve.out")"
fi

# --- ray down ----------------------------------------------------------------------------
log "ray down"
ctl "$VENV/bin/ray" down -y "$W/cluster.yaml" >"$W/down.log" 2>&1 || { tail -20 "$W/down.log"; exit 1; }
DOWN_DONE=1
# ray down runs `ray stop` on the head only; with the local provider a worker's raylet exits
# by itself once the GCS is gone for gcs_rpc_server_reconnect_timeout_s (60 s).
for i in "${!HOSTS[@]}"; do  # ([r]: the pattern must not match this command's own shell)
  for _ in $(seq 45); do
    left=$(on "$i" "pgrep -c -u $U -f '[r]aylet|[g]cs_server' || true")
    [ "$left" = 0 ] && break; sleep 2
  done
  log "host $i: no Ray process left"
  [ "$left" = 0 ] || { echo "host $i: $left Ray processes left after ray down"; on "$i" "ps -fu $U"; exit 1; }
done
log "cluster test passed"

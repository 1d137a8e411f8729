#!/usr/bin/env bash
# `make test`: the suite as two pytest processes at once. One runs the engine modules
# (tests/conftest.py ENGINE_MODULES: vLLM engines, Ray Serve apps, the demo; they keep a core
# busy starting processes that import torch and vLLM), the other the rest (the store on Ray clusters, unit,
# simulation, native: mostly waiting on Ray, actors and I/O). On one after the other the
# host's two cores were half idle.
#
# Each runs in network and mount namespaces of its own: its own loopback (Ray, Serve and
# Prometheus keep their default ports), its own ~/.ray (NS_PRE) and /tmp/ray (where Ray keeps
# its sessions and `ray_current_cluster`, which `serve run` and `ray.init("auto")` read), and
# its own pytest temporary directory. Everything else they share is built to be shared: the
# Ray nodes' arenas in /dev/shm (collected only when their raylet is gone), the tiny models
# (built under a lock), .venv.
#
# Usage: tests/shards.sh NS_PRE MAKE   (NS_PRE: the Makefile's namespace set-up commands)
set -u
pre=$1 make=$2
run=$(mktemp -d /tmp/mcr-test.XXXXXX)
shards=(engines store)

for name in "${shards[@]}"; do
  mkdir -p "$run/ray-$name"
  ( unshare --net --mount --propagation private sh -c "$pre mkdir -p /tmp/ray && mount --bind '$run/ray-$name' /tmp/ray && exec $make --no-print-directory test-inner SHARD=$name BASETEMP='$run/$name'" 2>&1
    echo $? > "$run/$name.rc"
  ) | sed -u "s/^/[$name] /" &
done
wait

rc=0
for name in "${shards[@]}"; do
  r=$(cat "$run/$name.rc" 2>/dev/null || echo "none")
  echo "[$name] exit status $r"
  [ "$r" = 0 ] || rc=1
done
if [ "$rc" = 0 ]; then rm -rf "$run"; else echo "Ray sessions and pytest's temporary files kept in $run"; fi
exit $rc

#!/usr/bin/env bash
# memcap.sh LIMIT COMMAND...  -- run COMMAND in a fresh memory cgroup of LIMIT bytes (2G, 512M,
# ...): its anonymous memory and page cache together stay below LIMIT, which is how a benchmark
# sees the out-of-core path on a machine with more RAM than the table. Needs root and a
# writable cgroup hierarchy (v1 "memory" controller or v2). When COMMAND ends, prints one line
# "memcap: limit L, peak P, limit hits: H" on stderr and exits with COMMAND's status.
# The benchmarks (benchmarks/ooc.py, buckets_ooc.py, random_loop.py, guard.py) use this copy.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: memcap.sh LIMIT COMMAND..." >&2; exit 2; fi
limit=$1; shift
bytes=$(numfmt --from=iec "${limit^^}")
name="dsa_memcap_$$"
if [ -d /sys/fs/cgroup/memory ]; then                 # v1
  cg=/sys/fs/cgroup/memory/$name
  mkdir "$cg" && echo "$bytes" > "$cg/memory.limit_in_bytes"
  peak=$cg/memory.max_usage_in_bytes; hits=$cg/memory.failcnt
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then   # v2
  cg=/sys/fs/cgroup/$name
  mkdir "$cg" && echo "$bytes" > "$cg/memory.max"
  peak=$cg/memory.peak; hits=$cg/memory.events
else
  echo "memcap.sh: no writable memory cgroup on this machine" >&2; exit 2
fi
trap 'rmdir "$cg" 2>/dev/null || true' EXIT
set +e
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' memcap "$cg" "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT HUP
wait "$pid"; rc=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done
set -e
h=$(grep -m1 -E '^max |^[0-9]' "$hits" 2>/dev/null || echo "?")
echo "memcap: limit $limit, peak $(numfmt --to=iec "$(cat "$peak" 2>/dev/null || echo 0)"), limit hits: $h" >&2
exit $rc

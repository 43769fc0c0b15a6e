#!/usr/bin/env bash
# start_pool.sh: start one Mooncake pool (a mooncake_master and one segment
# holder, mooncake_client) on this host, wait until the pool has capacity,
# print the PIDs, and exit. docs/deployment-ascend.md ("Mooncake store")
# shows how to use it; tests/integration/test_mooncake_docs.py runs it as
# the doc says (two pools side by side on one host).
#
# Usage (every option also reads the environment variable in brackets):
#   examples/mooncake/start_pool.sh [--host=IP] [--master-port=N]
#       [--metrics-port=N] [--holder-port=N] [--segment-size=SIZE]
#       [--metadata-server=S] [--protocol=P] [--timeout=SECONDS]
#       [--log-dir=DIR] [--bin-dir=DIR]
#
#   --host            [MC_HOST, 127.0.0.1]  address the master (RPC and
#                     metrics) and the holder bind to; other hosts' clients
#                     must reach it, so use the host's IP in a cluster
#   --master-port     [MC_MASTER_PORT, 50088]  mooncake_master --rpc_port
#                     (clients: mooncake_master_server_addr=HOST:PORT)
#   --metrics-port    [MC_METRICS_PORT, 9003]  mooncake_master --metrics_port,
#                     its HTTP admin/metrics server (/metrics)
#   --holder-port     [MC_HOLDER_PORT, 50052]  mooncake_client --port
#   --segment-size    [MC_SEGMENT_SIZE, 4GB]   mooncake_client
#                     --global_segment_size: DRAM this host lends (>= 16MB)
#   --metadata-server [MC_METADATA_SERVER, P2PHANDSHAKE]  the holder's
#                     --metadata_server; every client of this master must
#                     use the same one (mooncake_metadata_server)
#   --protocol        [MC_PROTOCOL, tcp]
#   --timeout         [MC_READY_TIMEOUT, 30]  seconds to wait for each of
#                     the master and the pool to become ready
#   --log-dir         [MC_LOG_DIR, ./mooncake-pool-<master-port>]
#   --bin-dir         [MC_BIN_DIR, where mooncake_master is on PATH]
#
# Two pools on one host need three different ports each: the master's RPC
# port, its metrics port (both servers of a second master otherwise collide
# and it exits, "Address already in use") and the holder's port (a second
# holder on the same port registers its segment with the master, then
# aborts on its socket).
#
# Ready means: the master's /metrics reports master_total_capacity_bytes > 0
# and the holder process itself listens on its --port (its last startup
# step, after it mounted its segment). The metrics alone are not enough: a
# holder that fails after mounting (e.g. its port taken) dies while its
# segment stays in the master's metrics until its lease runs out. The
# ports are also checked before anything starts, so a taken port is named
# at once. Linux only (reads /proc), as Mooncake is.
#
# Output on success (stdout, one per line): MOONCAKE_MASTER_PID=<pid>,
# MOONCAKE_HOLDER_PID=<pid>, MOONCAKE_CAPACITY_BYTES=<n>, then how to stop.
# On failure: a message on stderr, the end of the failed process's log,
# both processes stopped, exit status 1.
set -eu

host=${MC_HOST:-127.0.0.1}
master_port=${MC_MASTER_PORT:-50088}
metrics_port=${MC_METRICS_PORT:-9003}
holder_port=${MC_HOLDER_PORT:-50052}
segment_size=${MC_SEGMENT_SIZE:-4GB}
metadata_server=${MC_METADATA_SERVER:-P2PHANDSHAKE}
protocol=${MC_PROTOCOL:-tcp}
timeout_s=${MC_READY_TIMEOUT:-30}
log_dir=${MC_LOG_DIR:-}
bin_dir=${MC_BIN_DIR:-}

die() { echo "start_pool.sh: $*" >&2; exit 1; }

for arg in "$@"; do
    case $arg in
        --host=*) host=${arg#*=} ;;
        --master-port=*) master_port=${arg#*=} ;;
        --metrics-port=*) metrics_port=${arg#*=} ;;
        --holder-port=*) holder_port=${arg#*=} ;;
        --segment-size=*) segment_size=${arg#*=} ;;
        --metadata-server=*) metadata_server=${arg#*=} ;;
        --protocol=*) protocol=${arg#*=} ;;
        --timeout=*) timeout_s=${arg#*=} ;;
        --log-dir=*) log_dir=${arg#*=} ;;
        --bin-dir=*) bin_dir=${arg#*=} ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d'; exit 0 ;;
        *) die "unknown argument '$arg' (see --help)" ;;
    esac
done

for p in "$master_port" "$metrics_port" "$holder_port" "$timeout_s"; do
    case $p in ''|*[!0-9]*) die "'$p' is not a number (ports and --timeout are integers)" ;; esac
done
[ "$master_port" != "$metrics_port" ] && [ "$master_port" != "$holder_port" ] \
    && [ "$metrics_port" != "$holder_port" ] \
    || die "--master-port, --metrics-port and --holder-port must differ"
command -v curl >/dev/null || die "curl is needed to read the master's /metrics"
if [ -z "$bin_dir" ]; then
    master_bin=$(command -v mooncake_master) \
        || die "mooncake_master is not on PATH: pip install mooncake-transfer-engine-non-cuda (or set --bin-dir)"
    bin_dir=$(dirname "$master_bin")
fi
for b in mooncake_master mooncake_client; do
    [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing (set --bin-dir to the directory with $b)"
done
# 0 when something accepts TCP connections on $host:$1.
port_taken() { (exec 3<>"/dev/tcp/$host/$1") 2>/dev/null; }
for p in "master-port $master_port" "metrics-port $metrics_port" "holder-port $holder_port"; do
    set -- $p
    ! port_taken "$2" || die "--$1=$2: $host:$2 is already in use (another pool on this host? give each pool its own three ports)"
done

log_dir=${log_dir:-./mooncake-pool-$master_port}
mkdir -p "$log_dir"
metrics_url="http://$host:$metrics_port/metrics"

master_pid=""
holder_pid=""
# On failure stop what this script started (by PID), then say why.
fail() {
    echo "start_pool.sh: $1" >&2
    if [ -n "${2:-}" ] && [ -f "$2" ]; then
        echo "--- last lines of $2:" >&2
        tail -n 5 "$2" >&2
    fi
    stop $holder_pid $master_pid
    exit 1
}

# SIGTERM, then up to 10 s for the process to exit (a zombie has: it is
# our child and waits to be reaped), then SIGKILL; so its ports are free
# when this script exits.
stop() {
    for pid in "$@"; do
        kill "$pid" 2>/dev/null || true
        n=0
        while [ $n -lt 100 ]; do
            state=$(awk '/^State:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || true)
            case $state in ''|Z) break ;; esac
            sleep 0.1
            n=$((n + 1))
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

# 0 when $1 (a PID this shell started) is running; else reaps it and
# stores its exit status in $status.
alive() {
    kill -0 "$1" 2>/dev/null && return 0
    status=0
    wait "$1" 2>/dev/null || status=$?
    return 1
}

# 0 when process $1 itself listens on TCP port $2: one of its descriptors
# is the inode of a LISTEN (state 0A) socket on that port in /proc/net/tcp*.
owns_listener() {
    port_hex=$(printf ':%04X' "$2")
    for inode in $(awk -v p="$port_hex" '$4 == "0A" && substr($2, length($2) - 4) == p { print $10 }' \
            /proc/net/tcp /proc/net/tcp6 2>/dev/null); do
        ls -l "/proc/$1/fd" 2>/dev/null | grep -q "socket:\[$inode\]" && return 0
    done
    return 1
}

capacity() {
    curl -s --max-time 2 "$metrics_url" 2>/dev/null \
        | awk '$1 == "master_total_capacity_bytes" { print $2; found = 1 } END { if (!found) exit 1 }'
}

# Both processes get their own log and no terminal or pipe of ours, so
# they outlive this script and a caller reading its output sees EOF.
master_log=$log_dir/master.log
holder_log=$log_dir/holder.log
echo "+ $bin_dir/mooncake_master --rpc_port=$master_port --rpc_address=$host --metrics_port=$metrics_port --metrics_host=$host ..." >&2
"$bin_dir/mooncake_master" --rpc_port="$master_port" --rpc_address="$host" \
    --metrics_port="$metrics_port" --metrics_host="$host" \
    --eviction_high_watermark_ratio=0.9 --eviction_ratio=0.1 --default_kv_lease_ttl=11000 \
    </dev/null >"$master_log" 2>&1 &
master_pid=$!

# The holder mounts its segment at the master on start: wait for the
# master's metrics server to answer first.
deadline=$(( $(date +%s) + timeout_s ))
until capacity >/dev/null; do
    alive "$master_pid" || { master_pid=""; fail "mooncake_master exited with status $status before it served $metrics_url" "$master_log"; }
    [ "$(date +%s)" -lt "$deadline" ] || fail "mooncake_master did not serve $metrics_url within ${timeout_s} s" "$master_log"
    sleep 0.2
done

echo "+ $bin_dir/mooncake_client --master_server_address=$host:$master_port --metadata_server=$metadata_server --host=$host --port=$holder_port --protocol=$protocol --global_segment_size=$segment_size" >&2
"$bin_dir/mooncake_client" --master_server_address="$host:$master_port" \
    --metadata_server="$metadata_server" --host="$host" --port="$holder_port" \
    --protocol="$protocol" --global_segment_size="$segment_size" \
    </dev/null >"$holder_log" 2>&1 &
holder_pid=$!

deadline=$(( $(date +%s) + timeout_s ))
bytes=0
while :; do
    alive "$holder_pid" || { holder_pid=""; fail "the segment holder (mooncake_client --port=$holder_port) exited with status $status; the pool is not ready" "$holder_log"; }
    alive "$master_pid" || { master_pid=""; fail "mooncake_master exited with status $status" "$master_log"; }
    bytes=$(capacity || echo 0)
    # awk compares: the gauge may be printed in float notation.
    if awk -v b="$bytes" 'BEGIN { exit !(b + 0 > 0) }' && owns_listener "$holder_pid" "$holder_port"; then
        break
    fi
    [ "$(date +%s)" -lt "$deadline" ] \
        || fail "the pool did not become ready within ${timeout_s} s: $metrics_url reports master_total_capacity_bytes $bytes, holder listening on $host:$holder_port: $(owns_listener "$holder_pid" "$holder_port" && echo yes || echo no)" "$holder_log"
    sleep 0.2
done

echo "MOONCAKE_MASTER_PID=$master_pid"
echo "MOONCAKE_HOLDER_PID=$holder_pid"
echo "MOONCAKE_CAPACITY_BYTES=$bytes"
echo "pool ready: master $host:$master_port, metrics $metrics_url, logs in $log_dir"
echo "stop it with: kill $holder_pid $master_pid"

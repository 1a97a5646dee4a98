# Makes N hosts on this machine, so multi-host paths run for real: each host is a network namespace
# with its own address (10.77.0.K), hostname (nodeK) and sshd, joined to the others by a bridge.
# Open MPI, ssh, gRPC and the tf.data service see separate nodes; the file system is shared (as NFS
# home directories are on a cluster). Loopback-only: nothing leaves this machine.
#   source tests/hosts/local_hosts.sh && local_hosts 2     # node1, node2 (idempotent)
#   ssh node1 hostname                                           # -> node1
#   ip netns exec node2 COMMAND                                  # run COMMAND "on" node2 directly
#   local_hosts_down                                             # remove them
# Needs root (network namespaces, Debian's openssh-server, installed once). Tests that use it must
# skip cleanly where it cannot be set up.
LOCAL_HOSTS_NET=10.77.0
local_hosts() {
  local n=${1:-2} i
  command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || \
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server) >/dev/null 2>&1 || return 1
  mkdir -p /run/sshd /root/.ssh && chmod 700 /root/.ssh
  [ -f /etc/ssh/ssh_host_ed25519_key ] || ssh-keygen -A >/dev/null 2>&1
  [ -f /root/.ssh/id_ed25519 ] || ssh-keygen -q -t ed25519 -N "" -f /root/.ssh/id_ed25519 || return 1
  grep -qF "$(cat /root/.ssh/id_ed25519.pub)" /root/.ssh/authorized_keys 2>/dev/null || \
    cat /root/.ssh/id_ed25519.pub >> /root/.ssh/authorized_keys
  chmod 600 /root/.ssh/authorized_keys
  grep -q "^Host node\*" /root/.ssh/config 2>/dev/null || cat >> /root/.ssh/config <<'CONF'
Host node*
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
CONF
  if ! ip link show tfsh0 >/dev/null 2>&1; then
    ip link add tfsh0 type bridge && ip addr add $LOCAL_HOSTS_NET.254/24 dev tfsh0 && ip link set tfsh0 up || return 1
  fi
  for i in $(seq 1 "$n"); do
    if ! ip netns list | grep -qw "node$i"; then
      ip netns add "node$i" || return 1
      ip link add "vh$i" type veth peer name "vn$i" || return 1
      ip link set "vn$i" netns "node$i"
      ip link set "vh$i" master tfsh0 && ip link set "vh$i" up
      ip netns exec "node$i" ip addr add "$LOCAL_HOSTS_NET.$i/24" dev "vn$i"
      ip netns exec "node$i" ip link set "vn$i" up
      ip netns exec "node$i" ip link set lo up
    fi
    grep -qE "^$LOCAL_HOSTS_NET\.$i[[:space:]]+node$i\$" /etc/hosts || echo "$LOCAL_HOSTS_NET.$i node$i" >> /etc/hosts
    if ! [ -f "/run/sshd-node$i.pid" ] || ! kill -0 "$(cat "/run/sshd-node$i.pid")" 2>/dev/null; then
      ip netns exec "node$i" unshare --uts sh -c "hostname node$i; exec /usr/sbin/sshd \
        -o ListenAddress=$LOCAL_HOSTS_NET.$i -o PidFile=/run/sshd-node$i.pid -o UsePAM=no \
        -o PermitRootLogin=prohibit-password -o MaxStartups=100 -o MaxSessions=100" || return 1
    fi
  done
  for i in $(seq 1 "$n"); do
    local ok=""
    for _ in $(seq 1 20); do
      [ "$(ssh -o ConnectTimeout=2 "node$i" hostname 2>/dev/null)" = "node$i" ] && { ok=1; break; }
      sleep 0.5
    done
    [ -n "$ok" ] || { echo "local_hosts: node$i does not answer over ssh" >&2; return 1; }
  done
}
local_hosts_down() {
  local ns i
  for ns in $(ip netns list | grep -oE "^node[0-9]+"); do
    i=${ns#node}
    [ -f "/run/sshd-$ns.pid" ] && kill "$(cat "/run/sshd-$ns.pid")" 2>/dev/null; rm -f "/run/sshd-$ns.pid"
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null
    ip link del "vh$i" 2>/dev/null; ip netns del "$ns"
    sed -i "/^$LOCAL_HOSTS_NET\.$i[[:space:]]\+$ns\$/d" /etc/hosts
  done
  ip link del tfsh0 2>/dev/null || true
}

# Two "hosts" for the shaped-link benchmarks (sourced by bench/diloco.sh and
# bench/shaped_link.sh): network namespaces NS[0], NS[1] with addresses ADDR[0], ADDR[1], joined
# by one link whose ends are DEV[0], DEV[1]. Needs root.
#
#   link_up PREFIX DELAY_MS   (PREFIX: 2 letters; interface names are at most 15 characters)
#     DELAY_MS = 0: a veth pair.
#     DELAY_MS > 0: two TUN devices and bench/delay_link.py between them, holding every packet
#       DELAY_MS in each direction (round trip 2 x DELAY_MS): netem, tc's delay, is not in
#       these kernels.
#   shape RATE [LOG]          tbf on the egress of both ends ("none": unshaped); the command
#                             lines are appended to LOG when given.
# The namespaces (and the relay) go when the script exits.

LINK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

link_up() {
  local prefix=$1 delay=${2:-0} tag=$$
  NS=("${prefix}${tag}a" "${prefix}${tag}b")
  DEV=("${prefix}${tag}x" "${prefix}${tag}y")
  ADDR=(10.79.0.1 10.79.0.2)
  RELAY=
  trap link_down EXIT INT TERM
  ip netns add "${NS[0]}"
  ip netns add "${NS[1]}"
  if [ "$delay" = 0 ]; then
    ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
    for i in 0 1; do
      ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"
      ip -n "${NS[$i]}" link set lo up
      ip -n "${NS[$i]}" link set "${DEV[$i]}" up
    done
  else
    local ready
    ready=$(mktemp)
    python3 "$LINK_DIR/delay_link.py" "${NS[0]}" "${DEV[0]}" "${ADDR[0]}" \
      "${NS[1]}" "${DEV[1]}" "${ADDR[1]}" "$delay" >"$ready" &
    RELAY=$!
    for _ in $(seq 100); do
      grep -q ready "$ready" && break
      kill -0 "$RELAY" || { echo "link.sh: delay_link.py failed" >&2; exit 2; }
      sleep 0.1
    done
    rm -f "$ready"
  fi
}

link_down() {
  [ -n "${RELAY:-}" ] && kill "$RELAY" 2>/dev/null
  for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}

# burst >= rate / HZ (HZ <= 1000 here).
shape() {
  local rate=$1 log=${2:-/dev/null} burst cmd
  case $rate in
    10mbit) burst=16kb ;;
    100mbit) burst=64kb ;;
    1gbit) burst=512kb ;;
    *) burst=1mb ;;
  esac
  # tbf drops a packet larger than its bucket: the relay's TUN devices carry 65000-byte packets.
  [ -n "${RELAY:-}" ] && [ "$burst" != 512kb ] && [ "$burst" != 1mb ] && burst=128kb
  for i in 0 1; do
    tc -n "${NS[$i]}" qdisc del dev "${DEV[$i]}" root 2>/dev/null || true
    [ "$rate" = none ] && continue
    cmd="tc qdisc replace dev ${DEV[$i]} root tbf rate $rate burst $burst latency 50ms"
    echo "# [ns ${NS[$i]}] $cmd" >>"$log"
    ip netns exec "${NS[$i]}" $cmd
  done
}

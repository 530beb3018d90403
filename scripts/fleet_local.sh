#!/usr/bin/env bash
# Try the fleet on one machine (README "Try the fleet on one machine"): a local S3 (moto's server) and
# its bucket, two plugin replicas reading one s3:// root, vllm-router in front with the README's Fleet
# flags; the same parts tests/test_fleet.py starts. Ctrl-C (or SIGTERM) stops everything it started.
#
#   MODEL_DIR=.cache/tiny_models/qwen2_vl bash scripts/fleet_local.sh
#
# Knobs (environment): S3_PORT (9000), REPLICA_PORTS ("8001 8002"), ROUTER_PORT (30000),
# PROMETHEUS_PORT (29001), BUCKET (mmref-fleet), LOGS (fleet-logs: every part's log, and env.sh: the
# variables a client or a trainer on this machine needs). ~1-2 min to "fleet up" on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL_DIR:?set MODEL_DIR to the served model folder (a tiny one: .venv/bin/python scripts/make_tiny_models.py --family qwen2_vl)}"
S3_PORT=${S3_PORT:-9000}
REPLICA_PORTS=${REPLICA_PORTS:-"8001 8002"}
ROUTER_PORT=${ROUTER_PORT:-30000}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-29001}
BUCKET=${BUCKET:-mmref-fleet}
LOGS=${LOGS:-fleet-logs}
mkdir -p "$LOGS"
pids=()
stop() { trap - EXIT INT TERM; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
trap 'exit 130' INT TERM
wait_for() {  # URL PID NAME: until URL answers 200, or PID exits
  until curl -sf -o /dev/null "$1"; do
    kill -0 "$2" 2>/dev/null || { echo "fleet_local: $3 exited, see $LOGS" >&2; exit 1; }
    sleep 0.5
  done
}

# 1. A local S3 endpoint and the bucket (a plain HTTP PUT creates it).
.venv/bin/python -m moto.server -H 127.0.0.1 -p "$S3_PORT" > "$LOGS/moto.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$S3_PORT/moto-api/" "${pids[-1]}" moto
curl -sf -o /dev/null -X PUT "http://127.0.0.1:$S3_PORT/$BUCKET"
cat > "$LOGS/env.sh" <<EOF
export AWS_ENDPOINT_URL=http://127.0.0.1:$S3_PORT AWS_ACCESS_KEY_ID=fleet-local AWS_SECRET_ACCESS_KEY=fleet-local
export AWS_REGION=us-east-1 MMREF_STORE_ALLOW_HTTP=1 MMREF_ASSET_ROOTS=s3://$BUCKET/mmref
export ROUTER_URL=http://127.0.0.1:$ROUTER_PORT FLEET_ROOT=s3://$BUCKET/mmref MODEL_DIR=$MODEL_DIR
EOF
# shellcheck disable=SC1091
source "$LOGS/env.sh"

# 2. The replicas: the README's CPU serve command with the bucket as their one root.
workers=()
for port in $REPLICA_PORTS; do
  VLLM_PLUGINS=mmref VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --dtype float32 --logprobs-mode processed_logprobs --host 127.0.0.1 --port "$port" \
    > "$LOGS/replica-$port.log" 2>&1 &
  pids+=($!)
  workers+=("http://127.0.0.1:$port")
done
i=1
for port in $REPLICA_PORTS; do
  wait_for "http://127.0.0.1:$port/health" "${pids[$i]}" "replica $port"
  i=$((i + 1))
done

# 3. The router: the README's Fleet flags.
.venv/bin/vllm-router --host 127.0.0.1 --port "$ROUTER_PORT" --worker-urls "${workers[@]}" \
  --policy consistent_hash --prometheus-port "$PROMETHEUS_PORT" \
  --disable-circuit-breaker --disable-retries --health-check-interval-secs 1 --health-failure-threshold 1 \
  > "$LOGS/router.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$ROUTER_PORT/health" "${pids[-1]}" vllm-router
echo "fleet up: router $ROUTER_URL, replicas ${workers[*]}, root $FLEET_ROOT; source $LOGS/env.sh"
wait

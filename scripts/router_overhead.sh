#!/usr/bin/env bash
# Router overhead against a C backend: nginx answers a fixed chat completion; wrk measures it directly and
# through `kvroute serve`, at concurrency 1 and 64, in one run. Needs Debian's nginx and wrk
# (apt-get install nginx wrk). Everything listens on 127.0.0.1 and is stopped by PID at the end.
#   scripts/router_overhead.sh [seconds per run, default 10]
set -euo pipefail
cd "$(dirname "$0")/.."
duration="${1:-10}"
work="$(mktemp -d)"
nginx_port=18480
router_port=18400
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/nginx.conf" <<EOF
worker_processes 1;
pid $work/nginx.pid;
error_log $work/error.log;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $work;
  server {
    listen 127.0.0.1:$nginx_port;
    location /health { return 200; }
    location / {
      default_type application/json;
      return 200 '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"tiny-llama","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}';
    }
  }
}
EOF
nginx -c "$work/nginx.conf"

cat > "$work/router.yaml" <<EOF
models: [{name: tiny-llama}]
instances: [{name: nginx, url: "http://127.0.0.1:$nginx_port"}]
EOF
.venv/bin/kvroute serve --config "$work/router.yaml" --port "$router_port" > "$work/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$router_port/health" > /dev/null && break; sleep 0.1; done

cat > "$work/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hello"}],"max_tokens":1}'
EOF

printf '| path | concurrency | requests/s | p50 | p99 | errors |\n|---|---|---|---|---|---|\n'
for target in direct router; do
  port=$nginx_port; [ "$target" = router ] && port=$router_port
  for conns in 1 64; do
    out="$(wrk -t1 -c"$conns" -d"${duration}s" --latency -s "$work/post.lua" "http://127.0.0.1:$port/v1/chat/completions")"
    rps="$(awk '/Requests\/sec/ {print $2}' <<< "$out")"
    p50="$(awk '$1 == "50%" {print $2}' <<< "$out")"
    p99="$(awk '$1 == "99%" {print $2}' <<< "$out")"
    errors="$(awk '/Non-2xx|Socket errors/ {print}' <<< "$out" | tr '\n' ' ')"
    printf '| %s | %s | %s | %s | %s | %s |\n' "$target" "$conns" "$rps" "$p50" "$p99" "${errors:-0}"
  done
done

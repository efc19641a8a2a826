#!/usr/bin/env bash
# README's first command: fetch the default model, build, start `host serve`
# on a free port, ask it one chat question through the OpenAI API, print the
# answer, and stop the server. Leave it running with KEEP_SERVING=1.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/fetch-model.sh
bash scripts/build-release.sh
log=$(mktemp)
target/release/host serve --port "${PORT:-0}" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$log"' EXIT

# The server prints "listening on http://ADDR" once the model is loaded.
url=""
for _ in $(seq 600); do
  url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$log" | head -1)
  [ -n "$url" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.5
done
[ -n "$url" ] || { echo "the server did not start within 5 minutes" >&2; cat "$log" >&2; exit 1; }
echo "serving on $url" >&2

curl -sf "$url/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "SmolLM2-135M-Instruct.Q4_1",
  "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
  "max_tokens": 64, "temperature": 0
}' | python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'

# The same question answered as JSON that follows a schema (structured output,
# served by the plugin installed above).
curl -sf "$url/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "SmolLM2-135M-Instruct.Q4_1",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 64, "temperature": 0,
  "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": {
    "type": "object", "additionalProperties": false, "required": ["country", "capital"],
    "properties": {"country": {"type": "string", "maxLength": 40}, "capital": {"type": "string", "maxLength": 40}}}}}
}' | python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'

if [ "${KEEP_SERVING:-0}" = 1 ]; then
  echo "still serving on $url (Ctrl-C stops it)" >&2
  wait "$server"
fi

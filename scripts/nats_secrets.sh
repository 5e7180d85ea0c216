#!/usr/bin/env bash
# Writes random NATS passwords for deploy/nats.conf into .env, for running nats-server by
# hand with it: set -a; . ./.env; set +a; nats-server -c deploy/nats.conf
# (docker compose does not need it: its init service writes the secrets into a volume).
# Existing values are kept, so running it again changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
touch .env
chmod 600 .env
for who in ADMISSION SCHEDULER WORKER PREFIX_CACHE GATEWAY CLIENT OPERATOR ROUTE; do
  var="RLT_NATS_${who}_PASSWORD"
  if ! grep -q "^${var}=" .env; then
    echo "${var}=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')" >> .env
  fi
done
echo "NATS passwords are in .env (client user: client / \$RLT_NATS_CLIENT_PASSWORD)"

#!/bin/sh
# compose's `init` service: rlt's secrets, written once into DIR (the `secrets` volume) and
# kept on every later run (only what is missing is written):
#   DIR/<user>/nats_password   a random password for each NATS user that CONF
#                              (deploy/nats.conf) names: the services, client, operator,
#                              any tenant, and `route` (the cluster's routes)
#   DIR/gateway/api_key        the key HTTP clients present to the gateway
# Each rlt service mounts only its own DIR/<user>; the NATS nodes mount DIR (and read it with
# deploy/nats-entrypoint.sh). This prints where the client's secrets are, never a secret.
# usage: secrets-init.sh DIR CONF
set -eu
dir=$1
conf=$2
umask 077

# 32 random characters of [A-Za-z0-9] (no character that would need quoting in a URL)
random() { head -c 32 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 32; }

write_once() {  # FILE: a random secret, unless FILE already holds one
  [ -s "$1" ] && return 0
  mkdir -p "$(dirname "$1")"
  random >"$1.tmp"
  mv "$1.tmp" "$1"
}

users=$(sed -n 's/.*user: *\([A-Za-z0-9_-]*\), *password: *\$RLT_NATS_.*/\1/p' "$conf")
if [ -z "$users" ]; then
  echo "secrets-init: no NATS user in $conf" >&2
  exit 1
fi
for user in $users; do
  write_once "$dir/$user/nats_password"
done
write_once "$dir/gateway/api_key"

cat <<END
rlt secrets are in the \`secrets\` volume, kept across runs (\`docker compose down -v\` deletes them):
  gateway API key:       docker compose run --rm -T init cat $dir/gateway/api_key
  NATS client password:  docker compose run --rm -T init cat $dir/client/nats_password  (user: client)
END

#!/bin/sh
# The NATS nodes' entrypoint (compose.yaml): nats-server reads $NAME in its config from the
# environment but cannot read a file, so this exports, from the secrets volume that
# deploy/secrets-init.sh wrote ($RLT_SECRETS_DIR):
#   RLT_NATS_<USER>_PASSWORD for each $RLT_SECRETS_DIR/<user>/nats_password (what
#     deploy/nats.conf reads; the names of services.runtime.permissions.password_var)
#   RLT_NATS_ROUTE_URLS: each host:port of $RLT_NATS_ROUTES as a route URL carrying the route
#     credentials (deploy/nats-cluster.conf's routes)
# and then runs its arguments (nats-server ...). No secret reaches a command line.
set -eu
dir=${RLT_SECRETS_DIR:?}
for file in "$dir"/*/nats_password; do
  user=$(basename "$(dirname "$file")")
  var=RLT_NATS_$(printf %s "$user" | tr 'a-z-' 'A-Z_')_PASSWORD
  export "$var=$(cat "$file")"
done

route_password=$(cat "$dir/route/nats_password")
case $route_password in
  "" | *[!A-Za-z0-9]*)
    echo "nats-entrypoint: $dir/route/nats_password must be [A-Za-z0-9]+ (it goes in URLs)" >&2
    exit 1
    ;;
esac
urls=""
for host in $(printf %s "${RLT_NATS_ROUTES:?}" | tr ',' ' '); do
  urls="$urls${urls:+, }nats://route:$route_password@$host"
done
export RLT_NATS_ROUTE_URLS="[$urls]"
exec "$@"

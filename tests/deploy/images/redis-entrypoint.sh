#!/bin/sh
# redis-server as the redis user, protected mode off (the official image builds it that way).
set -eu
if [ "${1:-}" = redis-server ]; then
    shift
    chown -R redis:redis /data
    exec setpriv --reuid=redis --regid=redis --init-groups redis-server "$@" --protected-mode no
fi
exec "$@"

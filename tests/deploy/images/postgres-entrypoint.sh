#!/bin/sh
# The official postgres image's start-up, in short: on an empty data directory run initdb with
# POSTGRES_USER and POSTGRES_PASSWORD, create POSTGRES_DB on a server that listens on its socket
# only, then run the server on every address with scram-sha-256 password auth.
set -eu
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ "${1:-}" = postgres ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
    user=${POSTGRES_USER:-postgres}
    db=${POSTGRES_DB:-$user}
    mkdir -p "$PGDATA" /var/run/postgresql
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    if [ ! -s "$PGDATA/PG_VERSION" ]; then
        pwfile=$(mktemp)
        printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
        chown postgres "$pwfile"
        as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust \
            --auth-host=scram-sha-256 >/dev/null
        rm -f "$pwfile"
        echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
        as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        if [ "$db" != postgres ]; then
            as_postgres psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -q \
                -c "CREATE DATABASE \"$db\""
        fi
        as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
        echo "PostgreSQL init process complete; ready for start up."
    fi
    shift
    exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" \
        -c listen_addresses='*' "$@"
fi
exec "$@"

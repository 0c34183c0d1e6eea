# Installs with apt-get what a script needs and the machine lacks. Source
# it, then: need_postgres, need_redis, need_prometheus, need_chromium (each
# only notes what is missing), then install_needed.
NEEDED_PACKAGES=()

need_postgres() {
    if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
        NEEDED_PACKAGES+=(postgresql postgresql-contrib)
    fi
    command -v psql >/dev/null 2>&1 || NEEDED_PACKAGES+=(postgresql-client)
    command -v pgbench >/dev/null 2>&1 || NEEDED_PACKAGES+=(postgresql-client)
}

need_redis() {
    command -v redis-server >/dev/null 2>&1 || NEEDED_PACKAGES+=(redis-server)
}

need_prometheus() {
    command -v prometheus >/dev/null 2>&1 || NEEDED_PACKAGES+=(prometheus)
}

need_chromium() {
    command -v chromium >/dev/null 2>&1 || NEEDED_PACKAGES+=(chromium)
}

install_needed() {
    [ ${#NEEDED_PACKAGES[@]} -gt 0 ] || return 0
    echo "installing: ${NEEDED_PACKAGES[*]}"
    local sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${NEEDED_PACKAGES[@]}" >/dev/null
    NEEDED_PACKAGES=()
}

# The PostgreSQL server binaries' directory (the newest installed).
pg_bindir() {
    if ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1; then
        ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1
    else
        dirname "$(command -v initdb)"
    fi
}

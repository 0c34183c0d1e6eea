#!/usr/bin/env bash
# An ORM's own test suite, Django's, in ROUNDS interleaved rounds (default
# 3): directly, through PgBouncer (session mode) and through pgcache with
# its defaults. Prints each route's median wall time, its ratio to direct,
# pgcache's CPU time, the tests run, and the tests whose outcome differs
# from the direct run's.
#   DJANGO_SRC=/path/to/Django-X.Y.Z bench/orm-suite.sh [TEST-LABELS...]
# DJANGO_SRC is an unpacked source distribution, which carries the tests:
#   pip download --no-deps --no-binary :all: django==5.1.4 && tar xzf Django-5.1.4.tar.gz
# Its runner needs psycopg, asgiref and sqlparse (pip install "psycopg[binary]"
# asgiref sqlparse). The labels default to a DDL-heavy set of Django's test
# apps; each run makes its test databases and drops them.
source "$(dirname "$0")/lib.sh"
SRC=${DJANGO_SRC:?set DJANGO_SRC to an unpacked Django source distribution}
SRC=$(cd "$SRC" && pwd)
if [ $# -gt 0 ]; then LABELS=("$@"); else
    LABELS=(basic schema migrations model_fields queries expressions aggregation m2m_through \
        model_inheritance many_to_one one_to_one select_related transactions indexes constraints)
fi
python3 -c "import psycopg, asgiref, sqlparse" 2>/dev/null || {
    echo "Django's runner needs psycopg, asgiref and sqlparse: pip install \"psycopg[binary]\" asgiref sqlparse" >&2
    exit 1
}

build_pgcache
start_postgres
start_pgbouncer
CACHE_PORT=$(free_port)
printf '[replication]\nidle_release_secs = 1\n' >"$RUNDIR/orm.toml"
start_pgcache "$CACHE_PORT" --config "$RUNDIR/orm.toml"
CACHE_PID=$PGCACHE_PID

# settings PORT: a settings module for Django's runner on that port.
settings() {
    cat >"$RUNDIR/orm_$1.py" <<PY
DATABASES = {
    "default": {"ENGINE": "django.db.backends.postgresql", "NAME": "django",
                "USER": "postgres", "HOST": "127.0.0.1", "PORT": "$1"},
    "other": {"ENGINE": "django.db.backends.postgresql", "NAME": "django_other",
              "USER": "postgres", "HOST": "127.0.0.1", "PORT": "$1"},
}
SECRET_KEY = "pgcache-bench"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = False
PY
}

# run NAME PORT: "seconds tests failed" of one run; its failed tests are
# kept in $RUNDIR/NAME.failed.
run() {
    local name=$1 port=$2 start end log="$RUNDIR/$1.log"
    settings "$port"
    start=$(date +%s.%N)
    (cd "$SRC/tests" && PYTHONPATH="$SRC:$RUNDIR" python3 runtests.py --settings="orm_$port" \
        --parallel 1 --noinput "${LABELS[@]}" >"$log" 2>&1) || true
    end=$(date +%s.%N)
    # What a pooler still holds open keeps a test database from being
    # dropped by the runner: the next route starts from none.
    for db in test_django test_django_other; do
        psql_at "$PGPORT" postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1
    done
    grep -E '^(FAIL|ERROR): ' "$log" | sort -u >"$RUNDIR/$name.failed" || true
    local ran
    ran=$(grep -oE '^Ran [0-9]+ tests' "$log" | grep -oE '[0-9]+' || echo 0)
    python3 -c "print(f'{$end - $start:.1f} $ran $(wc -l <"$RUNDIR/$name.failed")')"
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$CACHE_PID/stat"; }
declare -A wall=() ran=() failed=()
cpu=""
for round in $(seq "${ROUNDS:-3}"); do
    for route in direct:"$PGPORT" pgbouncer:"$BOUNCER_PORT" pgcache:"$CACHE_PORT"; do
        IFS=: read -r name port <<<"$route"
        no_streams
        before=$(cpu_ticks)
        read -r secs tests fails <<<"$(run "$name$round" "$port")"
        [ "$name" = pgcache ] && cpu+=" $(( $(cpu_ticks) - before ))"
        wall[$name]+=" $secs"
        ran[$name]=$tests
        failed[$name]=$fails
        cp "$RUNDIR/$name$round.failed" "$RUNDIR/$name.failed"
    done
done
direct=$(median ${wall[direct]})
printf '%-10s %9s %7s %10s %7s %7s  %s\n' route seconds ratio 'cpu (s)' tests failed 'failed here, not directly'
for name in direct pgbouncer pgcache; do
    secs=$(median ${wall[$name]})
    cpu_s=-
    [ "$name" = pgcache ] && cpu_s=$(python3 -c "print($(median $cpu) / 100)")
    extra=$(comm -13 "$RUNDIR/direct.failed" "$RUNDIR/$name.failed" | tr '\n' ' ')
    printf '%-10s %9s %7s %10s %7s %7s  %s\n' "$name" "$secs" "$(ratio "$secs" "$direct")" "$cpu_s" \
        "${ran[$name]}" "${failed[$name]}" "${extra:--}"
done

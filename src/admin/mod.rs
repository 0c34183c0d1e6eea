//! The admin console: a client that connects to the virtual database
//! `admin.database` (default `pgcache`) talks to pgcache itself, never to
//! PostgreSQL. It logs in with SCRAM-SHA-256 as `admin.user` with
//! `admin.password` and speaks the simple query protocol, so psql works:
//!
//! | command | answer |
//! | --- | --- |
//! | `SHOW STATS` | totals and hit ratios, overall and per tier |
//! | `SHOW QUERIES [n]` | the top `n` (20) statements by calls, by normalised text |
//! | `SHOW TABLES` | per table: versions, invalidations, entries, publication state |
//! | `SHOW REPLICATION` | per database: stream state, lag, LSN, the slot and, resumed after a restart, the WAL it kept |
//! | `SHOW POOLS` | per database and user: clients by state, server connections, waits; each server's role and lag |
//! | `SHOW CLIENTS` | every client session: state, the server connection it holds, pin |
//! | `SHOW SERVERS` | transaction mode's server connections and replica connections, with role and lag |
//! | `SHOW REPLICAS` | each read replica: in rotation or why not, position, lag, reads routed |
//! | `SHOW CONFIG` | the configuration in force, secrets hidden |
//! | `SHOW VERSION` | pgcache's version |
//! | `INVALIDATE TABLE name` | bumps the table's version (every database, every instance) |
//! | `INVALIDATE TAG name` | bumps a tag of `/*+ cache tags=... */` (every database, every instance) |
//! | `INVALIDATE ALL` | bumps every database's epoch and empties the local tier |
//! | `RELOAD` | re-reads the configuration and applies what can change live |

mod pools;
mod stats;

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use bytes::{BufMut, BytesMut};
use pgwire::messages::data::{DataRow, FieldDescription, RowDescription};
use pgwire::messages::response::{
    CommandComplete, EmptyQueryResponse, ReadyForQuery, TransactionStatus,
};
use pgwire::messages::startup::{Authentication, ParameterStatus};
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{info, warn};

use crate::App;
use crate::cache::Bumps;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::messages::{self, encode, error_response, notice_response};
use crate::protocol::startup::Startup;
use crate::protocol::stream::FramedStream;
use crate::protocol::{frontend as fe, sqlstate};
use crate::scram::Verifier;
/// Admin commands are short: a larger message is a protocol violation.
const MAX_ADMIN_MESSAGE: usize = 64 * 1024;
const DEFAULT_TOP: usize = 20;

/// Serves one admin console session to its end.
pub async fn serve<C>(app: Arc<App>, mut client: FramedStream<C>, startup: &Startup)
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    client.set_max_frame(MAX_ADMIN_MESSAGE);
    if !log_in(&app, &mut client, startup.user()).await {
        return;
    }
    // After an extended-protocol message, everything up to Sync is skipped.
    let mut skipping = false;
    let mut out = BytesMut::new();
    loop {
        let frame = match client.read_frame().await {
            Ok(Some(frame)) => frame,
            Ok(None) | Err(_) => return,
        };
        out.clear();
        match frame[0] {
            fe::QUERY => {
                let body = &frame[HEADER_LEN..];
                let text = String::from_utf8_lossy(body.strip_suffix(&[0]).unwrap_or(body));
                run(&app, text.trim(), &mut out).await;
                encode(&mut out, ReadyForQuery::new(TransactionStatus::Idle));
            }
            fe::TERMINATE => return,
            fe::SYNC => {
                skipping = false;
                encode(&mut out, ReadyForQuery::new(TransactionStatus::Idle));
            }
            _ if skipping => continue,
            _ => {
                skipping = true;
                error_response(
                    &mut out,
                    "ERROR",
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    "the pgcache admin console speaks the simple query protocol only",
                );
            }
        }
        if client.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Checks the admin password and greets the console as PostgreSQL would;
/// false if the session ends here.
async fn log_in<C>(app: &App, client: &mut FramedStream<C>, user: &str) -> bool
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let config = app.config();
    let (code, message) = match authenticate(client, &config.admin.password).await {
        Ok(true) if user == config.admin.user => {
            info!(user, "admin console session");
            let mut out = BytesMut::new();
            encode(&mut out, Authentication::Ok);
            for (name, value) in [
                ("server_version", "15.0 (pgcache admin console)"),
                ("server_encoding", "UTF8"),
                ("client_encoding", "UTF8"),
                ("DateStyle", "ISO, MDY"),
                ("integer_datetimes", "on"),
                ("standard_conforming_strings", "on"),
                ("TimeZone", "UTC"),
            ] {
                encode(&mut out, ParameterStatus::new(name.into(), value.into()));
            }
            encode(&mut out, ReadyForQuery::new(TransactionStatus::Idle));
            return client.write_all(&out).await.is_ok();
        }
        Ok(_) => {
            warn!(user, "admin console: authentication failed");
            (
                sqlstate::INVALID_PASSWORD,
                format!("password authentication failed for user \"{user}\""),
            )
        }
        Err(e) => {
            warn!(user, error = %e, "admin console: login failed");
            (sqlstate::PROTOCOL_VIOLATION, e.to_string())
        }
    };
    let _ = client.write_all(&messages::fatal(code, &message)).await;
    false
}

/// SCRAM-SHA-256 against the configured password (a fresh salt each
/// time). `Ok(false)`: the proof was wrong.
async fn authenticate<C>(
    client: &mut FramedStream<C>,
    password: &str,
) -> Result<bool, crate::auth::ExchangeError>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let verifier = Verifier::random(password);
    crate::auth::sasl_server(client, verifier, None)
        .await
        .map(|key| key.is_some())
}

/// A result set of text columns.
fn table(out: &mut BytesMut, columns: &[&str], rows: &[Vec<String>]) {
    let fields = columns
        .iter()
        .map(|c| FieldDescription::new((*c).to_owned(), 0, 0, 25, -1, -1, 0))
        .collect();
    encode(out, RowDescription::new(fields));
    for row in rows {
        let mut data = BytesMut::new();
        for value in row {
            data.put_i32(value.len() as i32);
            data.put_slice(value.as_bytes());
        }
        encode(out, DataRow::new(data, row.len() as i16));
    }
    encode(out, CommandComplete::new(format!("SHOW {}", rows.len())));
}

fn complete(out: &mut BytesMut, tag: &str) {
    encode(out, CommandComplete::new(tag.to_owned()));
}

/// Runs one command, appending its answer (without ReadyForQuery).
async fn run(app: &App, text: &str, out: &mut BytesMut) {
    let command = text.trim_end_matches(';').trim();
    let words: Vec<&str> = command.split_whitespace().collect();
    let upper: Vec<String> = words.iter().map(|w| w.to_ascii_uppercase()).collect();
    let upper: Vec<&str> = upper.iter().map(String::as_str).collect();
    match upper.as_slice() {
        [] => encode(out, EmptyQueryResponse::new()),
        ["SHOW", "STATS"] => table(out, &["stat", "value"], &stats::stats(app)),
        ["SHOW", "QUERIES"] => queries(app, DEFAULT_TOP, out),
        ["SHOW", "QUERIES", n] => match n.parse() {
            Ok(n) => queries(app, n, out),
            Err(_) => error_response(
                out,
                "ERROR",
                sqlstate::SYNTAX_ERROR,
                "SHOW QUERIES takes a number",
            ),
        },
        ["SHOW", "TABLES"] => tables(app, out),
        ["SHOW", "REPLICATION"] => replication(app, out),
        ["SHOW", "POOLS"] => pools::pools(app, out),
        ["SHOW", "CLIENTS"] => pools::clients(app, out),
        ["SHOW", "SERVERS"] => pools::servers(app, out),
        ["SHOW", "REPLICAS"] => pools::replicas(app, out),
        ["SHOW", "CONFIG"] => table(out, &["key", "value"], &config_rows(app)),
        ["SHOW", "VERSION"] => table(
            out,
            &["version"],
            &[vec![format!("pgcache {}", env!("CARGO_PKG_VERSION"))]],
        ),
        ["INVALIDATE", "TABLE", _] => invalidate_table(app, words[2], out).await,
        ["INVALIDATE", "TAG", _] => invalidate_tag(app, words[2], out).await,
        ["INVALIDATE", "ALL"] => invalidate_all(app, out).await,
        ["RELOAD"] => reload(app, out),
        _ => error_response(
            out,
            "ERROR",
            sqlstate::SYNTAX_ERROR,
            &format!(
                "unknown admin command {command:?}: try SHOW STATS, SHOW QUERIES [n], SHOW TABLES, SHOW REPLICATION, \
                 SHOW POOLS, SHOW CLIENTS, SHOW SERVERS, SHOW REPLICAS, SHOW CONFIG, SHOW VERSION, INVALIDATE TABLE name, INVALIDATE TAG name, INVALIDATE ALL or RELOAD"
            ),
        ),
    }
}

/// `INVALIDATE TABLE name`: in every database, on every instance.
async fn invalidate_table(app: &App, name: &str, out: &mut BytesMut) {
    let name = name.trim_matches('"');
    let name = name
        .rsplit_once('.')
        .map_or(name, |(_, n)| n)
        .trim_matches('"');
    for (_, db) in app.cache.databases.all() {
        let mut bumps = Bumps::default();
        db.relation_families(name, &mut bumps);
        app.cache
            .invalidate(&db, bumps, &app.metrics.invalidations.admin)
            .send()
            .await;
    }
    info!(table = name, "admin: table invalidated");
    complete(out, "INVALIDATE");
}

/// `INVALIDATE TAG name`: in every database, on every instance.
async fn invalidate_tag(app: &App, tag: &str, out: &mut BytesMut) {
    let tag = tag.trim_matches(['"', '\'']);
    if !crate::hints::valid_tag(tag) {
        error_response(
            out,
            "ERROR",
            sqlstate::SYNTAX_ERROR,
            &format!("{tag:?} is not a tag: letters, digits, _ - or ."),
        );
        return;
    }
    for (_, db) in app.cache.databases.all() {
        let mut bumps = Bumps::default();
        bumps.add_family(db.versions.tag(tag));
        app.cache
            .invalidate(&db, bumps, &app.metrics.invalidations.admin)
            .send()
            .await;
    }
    info!(tag, "admin: tag invalidated");
    complete(out, "INVALIDATE");
}

async fn invalidate_all(app: &App, out: &mut BytesMut) {
    for (_, db) in app.cache.databases.all() {
        app.cache
            .invalidate(&db, Bumps::opaque(), &app.metrics.invalidations.admin)
            .send()
            .await;
    }
    app.cache.local.clear();
    info!("admin: everything invalidated");
    complete(out, "INVALIDATE");
}

fn reload(app: &App, out: &mut BytesMut) {
    match app.reload() {
        Ok(restart) => {
            if !restart.is_empty() {
                notice_response(
                    out,
                    "WARNING",
                    sqlstate::WARNING,
                    &format!(
                        "changed, but applied only at restart: {}",
                        restart.join(", ")
                    ),
                );
            }
            complete(out, "RELOAD");
        }
        Err(e) => error_response(
            out,
            "ERROR",
            sqlstate::CONFIG_FILE_ERROR,
            &format!("RELOAD failed, nothing changed: {e}"),
        ),
    }
}

pub(super) fn ratio(part: u64, whole: u64) -> String {
    if whole == 0 {
        "0.000".to_owned()
    } else {
        format!("{:.3}", part as f64 / whole as f64)
    }
}

fn timestamp(unix_ms: u64) -> String {
    if unix_ms == 0 {
        return String::new();
    }
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(unix_ms)).to_string()
}

fn queries(app: &App, n: usize, out: &mut BytesMut) {
    let mode = app.policy().mode;
    let rows: Vec<Vec<String>> = app
        .cache
        .stats
        .top(n)
        .into_iter()
        .map(|q| {
            let advice = crate::cache::advice::advise(&q, mode);
            vec![
                format!("{:016x}", q.id),
                q.calls.to_string(),
                q.hits.to_string(),
                q.misses.to_string(),
                ratio(q.hits, q.hits + q.misses),
                format!("{:.3}", q.mean_hit_ms),
                format!("{:.3}", q.mean_miss_ms),
                q.hit_bytes.to_string(),
                timestamp(q.last_invalidation_ms),
                q.would_hits.to_string(),
                format!("{:.3}", q.would_save_ms),
                q.mismatches.to_string(),
                q.verify_mismatches.to_string(),
                format!("{:.3}", q.backend_ms),
                q.invalidations.to_string(),
                q.suspensions.to_string(),
                q.not_admitted.to_string(),
                advice.action.to_owned(),
                advice.why,
                advice.hint.to_owned(),
                q.text,
            ]
        })
        .collect();
    table(
        out,
        &[
            "query_id",
            "calls",
            "hits",
            "misses",
            "hit_ratio",
            "mean_hit_ms",
            "mean_miss_ms",
            "hit_bytes",
            "last_invalidation",
            "would_hits",
            "would_save_ms",
            "shadow_mismatches",
            "verify_mismatches",
            "backend_ms",
            "invalidations",
            "suspensions",
            "not_admitted",
            "advice",
            "why",
            "hint",
            "query",
        ],
        &rows,
    );
}

fn tables(app: &App, out: &mut BytesMut) {
    let mut rows = Vec::new();
    for (name, db) in app.cache.databases.all() {
        let mut families = db.versions.tables();
        families.sort_by(|a, b| a.name.cmp(&b.name));
        // Left out for lack of a replica identity: listed whether or not a
        // statement has named them yet.
        for table in db.stream.unpublished_names() {
            let none = String::new;
            rows.push(vec![
                name.clone(),
                table,
                none(),
                none(),
                none(),
                none(),
                none(),
                "no replica identity".to_owned(),
                none(),
                none(),
                "no replica identity".to_owned(),
            ]);
        }
        for f in families {
            let facts = db.catalog.relation(&f.name);
            let publication = match &facts {
                Some(facts) if facts.readable => "published",
                Some(_) => "not published",
                None => "unknown",
            };
            let invalidated_by = match facts.as_ref().map(|f| f.identity.as_deref()) {
                Some(Some(identity)) => {
                    let names: Vec<&str> =
                        identity.columns.iter().map(|c| c.name.as_str()).collect();
                    format!("key ({})", names.join(", "))
                }
                Some(None) => "table".to_owned(),
                None => "unknown".to_owned(),
            };
            let (rows_changed, whole) = f.changes_by_scope();
            rows.push(vec![
                name.clone(),
                f.name.to_string(),
                f.version.local().to_string(),
                f.version.shared().to_string(),
                f.version.changes().to_string(),
                timestamp(f.version.last_change_ms()),
                f.version.entries().to_string(),
                publication.to_owned(),
                rows_changed.to_string(),
                whole.to_string(),
                invalidated_by,
            ]);
        }
    }
    table(
        out,
        &[
            "database",
            "table",
            "version",
            "shared_version",
            "invalidations",
            "last_invalidation",
            "entries",
            "publication",
            "row_invalidations",
            "table_invalidations",
            "invalidated_by",
        ],
        &rows,
    );
}

fn replication(app: &App, out: &mut BytesMut) {
    let rows: Vec<Vec<String>> = app
        .cache
        .databases
        .all()
        .into_iter()
        .map(|(name, db)| {
            vec![
                name,
                app.cache.stream_state(&db).to_owned(),
                db.stream.lag().as_millis().to_string(),
                db.stream.lag_bytes().to_string(),
                lsn(db.stream.applied_lsn()),
                db.stream.starts().to_string(),
                db.stream.unpublished().to_string(),
                db.stream.slot().unwrap_or_default(),
                db.stream
                    .slot_kept()
                    .map_or_else(String::new, |b| b.to_string()),
            ]
        })
        .collect();
    table(
        out,
        &[
            "database",
            "state",
            "lag_ms",
            "lag_bytes",
            "applied_lsn",
            "stream_starts",
            "unpublished_tables",
            "slot",
            "slot_kept_bytes",
        ],
        &rows,
    );
}

fn lsn(value: u64) -> String {
    format!("{:X}/{:X}", value >> 32, value & 0xffff_ffff)
}

/// Every key of the configuration in force, flattened, secrets hidden.
fn config_rows(app: &App) -> Vec<Vec<String>> {
    let config = app.config();
    let mut rows = Vec::new();
    if let Ok(value) = toml::Value::try_from(&*config) {
        flatten("", &value, &mut rows);
    }
    hide_secrets(&mut rows);
    rows
}

fn hide_secrets(rows: &mut [Vec<String>]) {
    for row in rows {
        match row[0].as_str() {
            "admin.password" if !row[1].is_empty() => row[1] = "***".to_owned(),
            // Passwords and SCRAM verifiers alike.
            key if key.starts_with("auth.users.") => row[1] = "***".to_owned(),
            "upstream.url" | "redis.url" => row[1] = hide_passwords(&row[1]),
            _ => {}
        }
    }
}

fn flatten(prefix: &str, value: &toml::Value, rows: &mut Vec<Vec<String>>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, rows);
            }
        }
        toml::Value::String(s) => rows.push(vec![prefix.to_owned(), s.clone()]),
        other => rows.push(vec![prefix.to_owned(), other.to_string()]),
    }
}

/// URLs lose their passwords, `key=value` strings their `password=`.
fn hide_passwords(text: &str) -> String {
    let text = text
        .split(',')
        .map(crate::config::redact)
        .collect::<Vec<_>>()
        .join(",");
    text.split(' ')
        .map(|part| match part.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => part.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden_in_urls_and_key_value_strings() {
        assert_eq!(
            hide_passwords("postgres://u:pw@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(
            hide_passwords("host=h password=pw user=u"),
            "host=h password=*** user=u"
        );
        assert_eq!(
            hide_passwords("redis://:a@h:1,redis://:b@h:2"),
            "redis://:***@h:1,redis://:***@h:2"
        );
    }

    #[test]
    fn show_config_hides_every_secret() {
        let mut config = crate::Config::default();
        config.admin.password = "adminpw".into();
        config.auth.users.insert("alice".into(), "alicepw".into());
        config.upstream.url = "postgres://u:dbpw@h/db".into();
        let mut rows = Vec::new();
        flatten("", &toml::Value::try_from(&config).unwrap(), &mut rows);
        hide_secrets(&mut rows);
        let all = format!("{rows:?}");
        for secret in ["adminpw", "alicepw", "dbpw"] {
            assert!(!all.contains(secret), "{secret} shown: {all}");
        }
        assert!(
            rows.iter()
                .any(|r| r[0] == "auth.users.alice" && r[1] == "***")
        );
    }

    #[test]
    fn lsns_print_as_postgresql_does() {
        assert_eq!(lsn(0x1_0000_00A0), "1/A0");
        assert_eq!(lsn(0), "0/0");
    }
}

//! What a statement does, from its text alone (pure, no I/O).
//!
//! [`analyze`] parses SQL with sqlparser's PostgreSQL dialect and reports,
//! per statement, whether it is a candidate for caching and what it may
//! change. It never looks at the catalog: whether a relation is a plain
//! table, or a function immutable, is decided later against the facts
//! pgcache learns of those names (`cache::catalog`). Anything the parser
//! does not understand is [`Effect::Opaque`]: treated as if it could have
//! changed anything; DDL also says which names it changed ([`Ddl`]).

mod ddl;
pub mod pins;
mod policy;
pub mod prerequisites;
mod visitor;

use std::collections::BTreeSet;

use sqlparser::ast::{CopySource, Statement, TransactionIsolationLevel, TransactionMode, Visit};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

pub use ddl::Ddl;
pub use policy::{PolicyFacts, policy_facts};
use visitor::{Facts, rel_name};
pub use visitor::{is_system_schema, normalize_ident};

/// Why a statement is not served from or stored in the cache. The labels
/// double as metric label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BypassReason {
    NotSelect,
    MultiStatement,
    ParseError,
    LockingClause,
    SelectInto,
    ModifyingCte,
    VolatileFunction,
    TimeLiteral,
    SystemCatalog,
    NotATable,
    /// A table missing from the publication: it has no replica identity,
    /// is unlogged, or DDL has not added it yet.
    NotPublished,
    UnknownRelation,
    TempObjects,
    InTransactionAfterWrite,
    IsolationLevel,
    SettingsUnknown,
    CatalogPending,
    TooLarge,
    Pipelined,
    UnsupportedShape,
    /// No replication stream is up for the database.
    ReplicationDown,
    /// The stream is up, but no heartbeat came back within
    /// `replication.max_staleness_ms`.
    ReplicationStale,
    /// `read_your_writes`, and Redis could not confirm the versions.
    Unconfirmed,
    /// `/*+ nocache */` or `/*NO QUERY CACHE*/`.
    Hint,
    /// `cache.mode = "opt_in"` and no hint asked.
    OptIn,
    TableRule,
    RoleRule,
    DatabaseRule,
    /// Adaptive admission: the statement's answers were retired before
    /// they were read, so it is not stored for a while.
    NotAdmitted,
}

impl BypassReason {
    /// Every reason, in declaration order (`reason as usize` indexes it).
    pub const ALL: [BypassReason; 29] = [
        Self::NotSelect,
        Self::MultiStatement,
        Self::ParseError,
        Self::LockingClause,
        Self::SelectInto,
        Self::ModifyingCte,
        Self::VolatileFunction,
        Self::TimeLiteral,
        Self::SystemCatalog,
        Self::NotATable,
        Self::NotPublished,
        Self::UnknownRelation,
        Self::TempObjects,
        Self::InTransactionAfterWrite,
        Self::IsolationLevel,
        Self::SettingsUnknown,
        Self::CatalogPending,
        Self::TooLarge,
        Self::Pipelined,
        Self::UnsupportedShape,
        Self::ReplicationDown,
        Self::ReplicationStale,
        Self::Unconfirmed,
        Self::Hint,
        Self::OptIn,
        Self::TableRule,
        Self::RoleRule,
        Self::DatabaseRule,
        Self::NotAdmitted,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::NotSelect => "not_select",
            Self::MultiStatement => "multi_statement",
            Self::ParseError => "parse_error",
            Self::LockingClause => "locking_clause",
            Self::SelectInto => "select_into",
            Self::ModifyingCte => "modifying_cte",
            Self::VolatileFunction => "volatile_function",
            Self::TimeLiteral => "time_literal",
            Self::SystemCatalog => "system_catalog",
            Self::NotATable => "not_a_table",
            Self::NotPublished => "not_published",
            Self::UnknownRelation => "unknown_relation",
            Self::TempObjects => "temp_objects",
            Self::InTransactionAfterWrite => "in_transaction_after_write",
            Self::IsolationLevel => "isolation_level",
            Self::SettingsUnknown => "settings_unknown",
            Self::CatalogPending => "catalog_pending",
            Self::TooLarge => "too_large",
            Self::Pipelined => "pipelined",
            Self::UnsupportedShape => "unsupported_shape",
            Self::ReplicationDown => "replication_down",
            Self::ReplicationStale => "replication_stale",
            Self::Unconfirmed => "unconfirmed",
            Self::Hint => "hint",
            Self::OptIn => "opt_in",
            Self::TableRule => "table_rule",
            Self::RoleRule => "role_rule",
            Self::DatabaseRule => "database_rule",
            Self::NotAdmitted => "not_admitted",
        }
    }
}

/// A relation name as written, identifiers normalised the way PostgreSQL
/// does: unquoted folded to lower case, quoted kept as is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelName {
    pub schema: Option<String>,
    pub name: String,
}

/// The isolation of a transaction, as far as the cache cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Isolation {
    /// READ COMMITTED or READ UNCOMMITTED: each statement sees what was
    /// committed when it began, as a cached result does.
    #[default]
    PerStatement,
    /// REPEATABLE READ or SERIALIZABLE: the transaction reads one
    /// snapshot, which the cache cannot serve.
    Snapshot,
}

/// How a statement starts a transaction block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Begin {
    /// At the session's default_transaction_isolation.
    #[default]
    AtDefault,
    /// At the isolation level it names.
    At(Isolation),
}

/// What running a statement may change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Reads only (its functions still need checking against the catalog).
    None,
    /// Writes rows of these relations (INSERT/UPDATE/DELETE/MERGE/TRUNCATE/
    /// COPY FROM, data-modifying CTEs). Every relation named in the statement
    /// is listed: over-invalidating what was only read is harmless.
    Write(Vec<RelName>),
    /// Changes session settings (SET, RESET, DISCARD, SET ROLE...).
    Settings,
    /// Starts a transaction block.
    Begin(Begin),
    /// Anything else: DDL, GRANT, CALL, DO, EXPLAIN ANALYZE, unparsable text.
    Opaque,
}

/// One analysed statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatementInfo {
    pub effect: Effect,
    /// `Ok` for a SELECT that may be cached if its relations and functions
    /// check out against the catalog.
    pub cacheable: Result<(), BypassReason>,
    /// Relations read (table functions and CTE names excluded).
    pub relations: Vec<RelName>,
    /// Functions called, by lower-cased unqualified name.
    pub functions: BTreeSet<String>,
    /// Creates a temporary object (CREATE TEMP TABLE ...).
    pub creates_temp: bool,
    /// For DDL and other opaque statements: the catalog objects it changes.
    pub ddl: Ddl,
    /// The rows of its one table it names by value ([`pins`]).
    pub pins: Option<pins::Pins>,
}

/// The whole text of one Query or Parse message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Analysis {
    pub statements: Vec<StatementInfo>,
}

impl Analysis {
    /// The single cacheable SELECT this text consists of, if it is one.
    pub fn cacheable_select(&self) -> Result<&StatementInfo, BypassReason> {
        match self.statements.as_slice() {
            [one] => one.cacheable.map(|()| one),
            [] => Err(BypassReason::NotSelect),
            _ => Err(BypassReason::MultiStatement),
        }
    }
}

/// Names that look like columns but are functions of the session or clock.
const SPECIAL_IDENTIFIERS: &[&str] = &[
    "current_user",
    "session_user",
    "current_role",
    "user",
    "current_schema",
    "current_catalog",
    "current_date",
    "current_time",
    "current_timestamp",
    "localtime",
    "localtimestamp",
    "system_user",
];

/// Input strings whose meaning depends on when they are parsed.
const TIME_LITERALS: &[&str] = &["now", "today", "tomorrow", "yesterday"];

/// First keywords of statements sqlparser may not parse but which cannot
/// change table data.
const HARMLESS_KEYWORDS: &[&str] = &[
    "show",
    "begin",
    "start",
    "commit",
    "end",
    "rollback",
    "abort",
    "savepoint",
    "release",
    "listen",
    "unlisten",
    "notify",
    "deallocate",
    "fetch",
    "move",
    "close",
    "checkpoint",
    "prepare transaction",
];
const SETTINGS_KEYWORDS: &[&str] = &["set", "reset", "discard"];

/// Analyses a SQL text. Never panics on any input.
pub fn analyze(sql: &str) -> Analysis {
    match Parser::parse_sql(&PostgreSqlDialect {}, sql) {
        Ok(statements) if !statements.is_empty() => {
            let literals = pins::Literals::new(sql);
            Analysis {
                statements: statements
                    .iter()
                    .map(|s| analyze_statement(s, &literals))
                    .collect(),
            }
        }
        Ok(_) => Analysis {
            statements: Vec::new(),
        },
        Err(_) => Analysis {
            statements: vec![fallback(sql)],
        },
    }
}

/// What to assume about text the parser rejected, from its first keyword.
fn fallback(sql: &str) -> StatementInfo {
    let lower = first_words(sql);
    let effect = if SETTINGS_KEYWORDS
        .iter()
        .any(|k| starts_with_word(&lower, k))
    {
        Effect::Settings
    } else if HARMLESS_KEYWORDS
        .iter()
        .any(|k| starts_with_word(&lower, k))
    {
        Effect::None
    } else {
        Effect::Opaque
    };
    let mut info = StatementInfo::new(effect);
    info.cacheable = Err(BypassReason::ParseError);
    info.creates_temp = lower.starts_with("create temp") || lower.starts_with("create local temp");
    info
}

/// The first few words of `sql`, comments skipped, lower-cased, single-spaced.
fn first_words(sql: &str) -> String {
    // Cut after an ASCII delimiter or white space: a character boundary.
    let skipped = crate::pool::marks::without_leading_comments(sql.as_bytes()).len();
    let rest = &sql[sql.len() - skipped..];
    rest.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
        .to_ascii_lowercase()
}

fn starts_with_word(text: &str, word: &str) -> bool {
    text.strip_prefix(word)
        .is_some_and(|r| r.is_empty() || !r.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
}

impl StatementInfo {
    fn new(effect: Effect) -> Self {
        let ddl = match effect {
            Effect::Opaque => Ddl::All,
            _ => Ddl::None,
        };
        Self {
            effect,
            cacheable: Err(BypassReason::NotSelect),
            relations: Vec::new(),
            functions: BTreeSet::new(),
            creates_temp: false,
            ddl,
            pins: None,
        }
    }
}

fn analyze_statement(stmt: &Statement, literals: &pins::Literals<'_>) -> StatementInfo {
    let mut facts = Facts::default();
    let _ = stmt.visit(&mut facts);
    let mut relations = facts.relations();
    if let Statement::Copy {
        source: CopySource::Table { table_name, .. },
        ..
    } = stmt
    {
        relations.extend(rel_name(table_name));
    }
    let mut info = StatementInfo::new(effect_of(stmt, &facts, &relations));
    info.functions = std::mem::take(&mut facts.functions);
    info.creates_temp = match stmt {
        Statement::CreateTable(t) => t.temporary,
        Statement::CreateView(v) => v.temporary,
        Statement::CreateSequence { temporary, .. } => *temporary,
        _ => false,
    };
    info.relations = relations;
    info.cacheable = cacheable_of(stmt, &facts, &info);
    info.pins = pins::pins_of(stmt, facts.raw_relations.len(), literals);
    if info.effect == Effect::Opaque {
        info.ddl = ddl::ddl_of(stmt);
    }
    info
}

/// What running `stmt` may change.
fn effect_of(stmt: &Statement, facts: &Facts, relations: &[RelName]) -> Effect {
    match stmt {
        Statement::Query(_) if facts.nested_dml => Effect::Write(relations.to_vec()),
        Statement::Query(_) if facts.select_into => Effect::Opaque,
        Statement::Query(_) => Effect::None,
        Statement::Insert(_)
        | Statement::Update(_)
        | Statement::Delete(_)
        | Statement::Merge(_)
        | Statement::Truncate(_) => Effect::Write(relations.to_vec()),
        Statement::Copy { to: true, .. } => Effect::None,
        Statement::Copy {
            source: CopySource::Table { .. },
            ..
        } => Effect::Write(relations.to_vec()),
        Statement::StartTransaction { modes, .. } => {
            let level = modes.iter().find_map(|m| match m {
                TransactionMode::IsolationLevel(level) => Some(level),
                _ => None,
            });
            Effect::Begin(match level {
                None => Begin::AtDefault,
                Some(
                    TransactionIsolationLevel::ReadCommitted
                    | TransactionIsolationLevel::ReadUncommitted,
                ) => Begin::At(Isolation::PerStatement),
                Some(_) => Begin::At(Isolation::Snapshot),
            })
        }
        Statement::Commit { .. }
        | Statement::Rollback { .. }
        | Statement::Savepoint { .. }
        | Statement::ReleaseSavepoint { .. }
        | Statement::ShowVariable { .. }
        | Statement::ShowVariables { .. }
        | Statement::Declare { .. }
        | Statement::Fetch { .. }
        | Statement::Close { .. }
        | Statement::Deallocate { .. }
        | Statement::LISTEN { .. }
        | Statement::UNLISTEN { .. }
        | Statement::NOTIFY { .. }
        | Statement::Lock(_) => Effect::None,
        Statement::Explain { analyze: false, .. } => Effect::None,
        Statement::Set(_) | Statement::Reset(_) | Statement::Discard { .. } => Effect::Settings,
        _ => Effect::Opaque,
    }
}

/// Whether a statement may be served from the cache, as far as its text
/// tells (the catalog decides the rest).
fn cacheable_of(stmt: &Statement, facts: &Facts, info: &StatementInfo) -> Result<(), BypassReason> {
    if !matches!(stmt, Statement::Query(_)) || info.effect != Effect::None {
        Err(if facts.nested_dml {
            BypassReason::ModifyingCte
        } else if facts.select_into {
            BypassReason::SelectInto
        } else {
            BypassReason::NotSelect
        })
    } else if facts.locking {
        Err(BypassReason::LockingClause)
    } else if facts.special_identifier {
        Err(BypassReason::VolatileFunction)
    } else if facts.time_literal {
        Err(BypassReason::TimeLiteral)
    } else if info
        .relations
        .iter()
        .any(|r| is_system_schema(r.schema.as_deref()))
    {
        Err(BypassReason::SystemCatalog)
    } else {
        Ok(())
    }
}

/// Whether a text-format parameter value is one of PostgreSQL's special
/// time inputs ('now', 'today'...): its meaning changes with the clock.
pub fn is_time_literal_text(value: &[u8]) -> bool {
    let matches = |text: &[u8]| {
        TIME_LITERALS
            .iter()
            .any(|t| text.eq_ignore_ascii_case(t.as_bytes()))
    };
    if !value.is_ascii() {
        // Unicode's white space too, which a server encoding's locale may
        // call space.
        return std::str::from_utf8(value).is_ok_and(|s| matches(s.trim().as_bytes()));
    }
    // C's isspace, as PostgreSQL's date/time input skips it.
    let space = |b: &u8| b.is_ascii_whitespace() || *b == 0x0b;
    let start = value.iter().position(|b| !space(b)).unwrap_or(value.len());
    // Each literal starts with n, t or y: most parameters (numbers, ids)
    // are told apart by their first byte.
    if !matches!(value.get(start).map(|b| b | 0x20), Some(b'n' | b't' | b'y')) {
        return false;
    }
    let end = value
        .iter()
        .rposition(|b| !space(b))
        .map_or(start, |e| e + 1);
    matches(&value[start..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reasons_are_listed_in_order() {
        for (i, r) in BypassReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
        }
        let labels: std::collections::HashSet<_> =
            BypassReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), BypassReason::ALL.len());
    }

    fn one(sql: &str) -> StatementInfo {
        let a = analyze(sql);
        assert_eq!(a.statements.len(), 1, "{sql}: {a:?}");
        a.statements.into_iter().next().unwrap()
    }

    fn rel(schema: Option<&str>, name: &str) -> RelName {
        RelName {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        }
    }

    #[test]
    fn plain_selects_are_candidates_with_their_tables() {
        type Tables<'a> = &'a [(Option<&'a str>, &'a str)];
        let cases: &[(&str, Tables)] = &[
            ("SELECT * FROM t WHERE id = $1", &[(None, "t")]),
            (
                "select a from Public.Items i join orders o on o.id = i.oid",
                &[(None, "orders"), (Some("public"), "items")],
            ),
            ("SELECT * FROM \"MixedCase\"", &[(None, "MixedCase")]),
            (
                "SELECT (SELECT max(x) FROM s.u) FROM t",
                &[(None, "t"), (Some("s"), "u")],
            ),
            (
                "WITH c AS (SELECT * FROM t) SELECT * FROM c",
                &[(None, "t")],
            ),
            (
                "SELECT * FROM generate_series(1, 3) g JOIN t ON t.id = g",
                &[(None, "t")],
            ),
            ("SELECT 1", &[]),
            (
                "SELECT a FROM t UNION SELECT b FROM u",
                &[(None, "t"), (None, "u")],
            ),
        ];
        for (sql, tables) in cases {
            let info = one(sql);
            assert_eq!(info.cacheable, Ok(()), "{sql}");
            assert_eq!(info.effect, Effect::None, "{sql}");
            let mut want: Vec<RelName> = tables.iter().map(|(s, n)| rel(*s, n)).collect();
            want.sort();
            assert_eq!(info.relations, want, "{sql}");
        }
    }

    #[test]
    fn never_cacheable_statements_say_why() {
        use BypassReason::*;
        let cases: &[(&str, BypassReason)] = &[
            ("INSERT INTO t VALUES (1)", NotSelect),
            ("UPDATE t SET a = 1", NotSelect),
            ("SELECT * FROM t FOR UPDATE", LockingClause),
            ("SELECT * FROM t FOR SHARE", LockingClause),
            ("SELECT * INTO newt FROM t", SelectInto),
            (
                "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
                ModifyingCte,
            ),
            ("SELECT current_user", VolatileFunction),
            ("SELECT CURRENT_TIMESTAMP", VolatileFunction),
            ("SELECT 'now'::timestamptz", TimeLiteral),
            ("SELECT * FROM t WHERE d > 'today'", TimeLiteral),
            ("SELECT * FROM pg_catalog.pg_class", SystemCatalog),
            ("SELECT * FROM information_schema.tables", SystemCatalog),
            ("SELECT * FROM pg_temp.x", SystemCatalog),
            ("SELECT 1 FROM (((", ParseError),
        ];
        for (sql, reason) in cases {
            assert_eq!(one(sql).cacheable, Err(*reason), "{sql}");
        }
        assert_eq!(
            analyze("SELECT 1; SELECT 2")
                .cacheable_select()
                .unwrap_err(),
            MultiStatement
        );
    }

    #[test]
    fn functions_are_collected_for_the_catalog_check() {
        let info =
            one("SELECT lower(name), now(), pg_catalog.upper(x) FROM t WHERE f(id) > random()");
        let want: BTreeSet<String> = ["lower", "now", "upper", "f", "random"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(info.functions, want);
        assert_eq!(
            info.cacheable,
            Ok(()),
            "volatility is judged against pg_proc, later"
        );
    }

    #[test]
    fn writes_name_every_relation_they_touch() {
        let cases: &[(&str, &[&str])] = &[
            ("INSERT INTO t SELECT * FROM u", &["t", "u"]),
            ("UPDATE t SET a = u.a FROM u WHERE t.id = u.id", &["t", "u"]),
            ("DELETE FROM t USING u WHERE t.id = u.id", &["t", "u"]),
            ("TRUNCATE t, u", &["t", "u"]),
            ("COPY t FROM STDIN", &["t"]),
            (
                "MERGE INTO t USING u ON t.id = u.id WHEN MATCHED THEN DELETE",
                &["t", "u"],
            ),
            (
                "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
                &["t"],
            ),
        ];
        for (sql, tables) in cases {
            let Effect::Write(rels) = one(sql).effect else {
                panic!("{sql} is not a write")
            };
            let names: Vec<&str> = rels.iter().map(|r| r.name.as_str()).collect();
            assert_eq!(names, *tables, "{sql}");
        }
        assert_eq!(one("COPY t TO STDOUT").effect, Effect::None);
    }

    #[test]
    fn session_and_transaction_statements() {
        assert_eq!(one("SET search_path = a, b").effect, Effect::Settings);
        assert_eq!(one("RESET ALL").effect, Effect::Settings);
        assert_eq!(one("SET ROLE alice").effect, Effect::Settings);
        assert_eq!(
            one("SET SESSION AUTHORIZATION alice").effect,
            Effect::Settings
        );
        assert_eq!(one("DISCARD ALL").effect, Effect::Settings);
        assert_eq!(one("BEGIN").effect, Effect::Begin(Begin::AtDefault));
        assert_eq!(
            one("BEGIN ISOLATION LEVEL REPEATABLE READ").effect,
            Effect::Begin(Begin::At(Isolation::Snapshot))
        );
        assert_eq!(
            one("START TRANSACTION ISOLATION LEVEL SERIALIZABLE").effect,
            Effect::Begin(Begin::At(Isolation::Snapshot))
        );
        assert_eq!(
            one("BEGIN READ ONLY ISOLATION LEVEL READ COMMITTED").effect,
            Effect::Begin(Begin::At(Isolation::PerStatement))
        );
        assert_eq!(one("COMMIT").effect, Effect::None);
        assert_eq!(one("ROLLBACK").effect, Effect::None);
    }

    #[test]
    fn unknown_effects_are_opaque() {
        for sql in [
            "CREATE TABLE x(a int)",
            "ALTER TABLE t ADD COLUMN b int",
            "DROP TABLE t",
            "GRANT SELECT ON t TO bob",
            "REVOKE SELECT ON t FROM bob",
            "CALL do_things()",
            "DO $$ BEGIN PERFORM 1; END $$",
            "EXPLAIN ANALYZE DELETE FROM t",
            "VACUUM t",
            "some words the parser has never seen",
        ] {
            assert_eq!(one(sql).effect, Effect::Opaque, "{sql}");
        }
        assert!(one("CREATE TEMP TABLE x(a int)").creates_temp);
        assert!(one("CREATE TEMPORARY VIEW v AS SELECT 1").creates_temp);
    }

    #[test]
    fn unparsable_but_harmless_statements_keep_their_nature() {
        assert_eq!(fallback("SHOW ALL whatever(").effect, Effect::None);
        assert_eq!(
            fallback("/* c */ SET LOCAL something odd(").effect,
            Effect::Settings
        );
        assert_eq!(fallback("-- c\nselect broken((").effect, Effect::Opaque);
        assert!(!starts_with_word("settle", "set"));
    }

    #[test]
    fn policy_expressions_report_settings_and_dependencies() {
        let p =
            policy_facts("(tenant_id = (current_setting('app.tenant'::text))::integer)").unwrap();
        assert_eq!(p.settings, vec!["app.tenant".to_owned()]);
        assert!(!p.opaque);
        let p = policy_facts("(owner = CURRENT_USER)").unwrap();
        assert!(!p.opaque && p.settings.is_empty());
        let p = policy_facts("(EXISTS ( SELECT 1 FROM members m WHERE (m.uid = t.uid)))").unwrap();
        assert!(p.opaque, "reads another table");
        let p = policy_facts("(current_setting(name_col) = 'x'::text)").unwrap();
        assert!(p.opaque, "computed setting name");
        let p = policy_facts("(app_tenant() = tenant_id)").unwrap();
        assert!(p.functions.contains("app_tenant"));
    }

    #[test]
    fn time_literal_parameters_are_spotted() {
        assert!(is_time_literal_text(b" NOW "));
        assert!(is_time_literal_text(b"\x0b\ttoday\r\n"));
        assert!(is_time_literal_text("\u{a0}yesterday".as_bytes()));
        assert!(!is_time_literal_text(b""));
        assert!(!is_time_literal_text(b"  "));
        assert!(!is_time_literal_text(b"nowhere"));
        assert!(is_time_literal_text(b"tomorrow"));
        assert!(!is_time_literal_text(b"2024-01-01"));
        assert!(!is_time_literal_text(&[0xff, 0xfe]));
        // The first-byte shortcut must let every literal, in any case, through.
        for t in TIME_LITERALS {
            assert!(is_time_literal_text(t.as_bytes()), "{t}");
            assert!(is_time_literal_text(t.to_uppercase().as_bytes()), "{t}");
        }
    }
}

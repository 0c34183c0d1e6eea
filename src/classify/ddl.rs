//! Which catalog objects a DDL statement changes, by name, so that pgcache
//! forgets exactly those facts. Anything not recognised here changes
//! [`Ddl::All`].

use sqlparser::ast::{
    AlterTable, AlterTableOperation, ColumnOption, CreateTable, ObjectName, ObjectType,
    RenameTableNameKind, Statement, TableConstraint,
};

use super::visitor::rel_name;

/// What a DDL statement changed in the catalog, as far as pgcache can tell.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub enum Ddl {
    /// No DDL.
    #[default]
    None,
    /// Relations and functions of these (bare) names, in any schema.
    Objects(Vec<Box<str>>),
    /// Anything in the catalog.
    All,
}

impl Ddl {
    pub fn is_none(&self) -> bool {
        matches!(self, Ddl::None)
    }

    /// Whether it changed facts pgcache keeps about the catalog.
    pub fn changes_facts(&self) -> bool {
        match self {
            Ddl::None => false,
            Ddl::Objects(names) => !names.is_empty(),
            Ddl::All => true,
        }
    }

    /// A change of these names (no names: DDL that changed no facts pgcache
    /// keeps, such as CREATE INDEX or GRANT).
    pub fn objects<S: Into<Box<str>>>(names: impl IntoIterator<Item = S>) -> Ddl {
        Ddl::Objects(names.into_iter().map(Into::into).collect())
    }

    pub fn merge(&mut self, other: &Ddl) {
        match (&mut *self, other) {
            (_, Ddl::None) | (Ddl::All, _) => {}
            (Ddl::Objects(mine), Ddl::Objects(theirs)) => {
                for name in theirs {
                    if !mine.contains(name) {
                        mine.push(name.clone());
                    }
                }
            }
            (me, _) => *me = other.clone(),
        }
    }
}

/// What `stmt` (already known to be DDL or otherwise opaque) changes.
pub(super) fn ddl_of(stmt: &Statement) -> Ddl {
    let mut names = Names::default();
    let known = match stmt {
        Statement::CreateTable(t) => created_table(t, &mut names),
        Statement::CreateView(v) => names.add(&v.name),
        Statement::AlterView { name, .. } => names.add(name),
        Statement::AlterTable(t) => altered_table(t, &mut names),
        Statement::Drop {
            object_type,
            names: dropped,
            ..
        } => {
            !matches!(object_type, ObjectType::Schema | ObjectType::Database)
                && dropped.iter().all(|n| names.add(n))
        }
        Statement::CreateFunction(f) => names.add(&f.name),
        Statement::CreateProcedure { name, .. } => names.add(name),
        Statement::DropFunction(f) => f.func_desc.iter().all(|d| names.add(&d.name)),
        Statement::DropProcedure { proc_desc, .. } => proc_desc.iter().all(|d| names.add(&d.name)),
        Statement::CreatePolicy(p) => names.add(&p.table_name),
        Statement::AlterPolicy(p) => names.add(&p.table_name),
        Statement::DropPolicy(p) => names.add(&p.table_name),
        Statement::CreateTrigger(t) => names.add(&t.table_name),
        Statement::DropTrigger(t) => t.table_name.as_ref().is_some_and(|n| names.add(n)),
        // Facts pgcache keeps do not change.
        Statement::CreateIndex(_)
        | Statement::Comment { .. }
        | Statement::Grant { .. }
        | Statement::Revoke { .. }
        | Statement::CreateSchema { .. }
        | Statement::Analyze { .. } => true,
        _ => false,
    };
    if known { names.into_ddl() } else { Ddl::All }
}

/// Names what `CREATE TABLE t` changes: `t`, its parents, and the tables
/// its foreign keys reference; false if it cannot tell (`LIKE`).
fn created_table(t: &CreateTable, names: &mut Names) -> bool {
    names.add(&t.name);
    // New children change their parents' facts; foreign keys with
    // cascading actions change the referenced table's.
    for parent in t.inherits.iter().flatten().chain(&t.partition_of) {
        names.add(parent);
    }
    for c in &t.constraints {
        if let TableConstraint::ForeignKey(fk) = c {
            names.add(&fk.foreign_table);
        }
    }
    for col in &t.columns {
        for option in &col.options {
            if let ColumnOption::ForeignKey(fk) = &option.option {
                names.add(&fk.foreign_table);
            }
        }
    }
    t.like.is_none()
}

/// Names what `ALTER TABLE t` changes; false if it cannot tell.
fn altered_table(t: &AlterTable, names: &mut Names) -> bool {
    names.add(&t.name);
    t.operations.iter().all(|op| match op {
        AlterTableOperation::RenameTable { table_name } => match table_name {
            RenameTableNameKind::As(n) | RenameTableNameKind::To(n) => names.add(n),
        },
        AlterTableOperation::AddConstraint { constraint, .. } => match constraint {
            TableConstraint::ForeignKey(fk) => names.add(&fk.foreign_table),
            _ => true,
        },
        // Only the table's own facts change.
        AlterTableOperation::AddColumn { .. }
        | AlterTableOperation::DropColumn { .. }
        | AlterTableOperation::AlterColumn { .. }
        | AlterTableOperation::RenameColumn { .. }
        | AlterTableOperation::RenameConstraint { .. }
        | AlterTableOperation::DropConstraint { .. }
        | AlterTableOperation::DropPrimaryKey { .. }
        | AlterTableOperation::DropForeignKey { .. }
        | AlterTableOperation::ValidateConstraint { .. }
        | AlterTableOperation::EnableRowLevelSecurity
        | AlterTableOperation::DisableRowLevelSecurity
        | AlterTableOperation::ForceRowLevelSecurity
        | AlterTableOperation::NoForceRowLevelSecurity
        | AlterTableOperation::EnableTrigger { .. }
        | AlterTableOperation::DisableTrigger { .. }
        | AlterTableOperation::EnableAlwaysTrigger { .. }
        | AlterTableOperation::EnableReplicaTrigger { .. }
        | AlterTableOperation::EnableRule { .. }
        | AlterTableOperation::DisableRule { .. }
        | AlterTableOperation::EnableAlwaysRule { .. }
        | AlterTableOperation::EnableReplicaRule { .. }
        | AlterTableOperation::ReplicaIdentity { .. }
        | AlterTableOperation::SetLogged
        | AlterTableOperation::SetUnlogged
        | AlterTableOperation::OwnerTo { .. }
        | AlterTableOperation::SetOptionsParens { .. } => true,
        // Partitions attached or detached, and the rest: anything.
        _ => false,
    })
}

#[derive(Default)]
struct Names(Vec<Box<str>>);

impl Names {
    /// Adds the bare name of `name`; false if it has none.
    fn add(&mut self, name: &ObjectName) -> bool {
        match rel_name(name) {
            Some(rel) => {
                if !self.0.iter().any(|n| **n == *rel.name) {
                    self.0.push(rel.name.into());
                }
                true
            }
            None => false,
        }
    }

    fn into_ddl(self) -> Ddl {
        Ddl::Objects(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::analyze;
    use super::*;

    fn ddl(sql: &str) -> Ddl {
        let a = analyze(sql);
        assert_eq!(a.statements.len(), 1, "{sql}");
        a.statements[0].ddl.clone()
    }

    #[test]
    fn ddl_names_merge_and_all_absorbs_them() {
        let mut d = Ddl::None;
        d.merge(&Ddl::objects(["t"]));
        d.merge(&Ddl::objects(["t", "f"]));
        assert_eq!(d, Ddl::objects(["t", "f"]));
        d.merge(&Ddl::All);
        d.merge(&Ddl::objects(["u"]));
        assert_eq!(d, Ddl::All);
    }

    #[test]
    fn ddl_names_what_it_changes() {
        let cases: &[(&str, &[&str])] = &[
            ("CREATE TABLE t (a int)", &["t"]),
            ("CREATE TABLE s.\"T\" (a int)", &["T"]),
            (
                "CREATE TABLE c (a int REFERENCES p ON DELETE CASCADE)",
                &["c", "p"],
            ),
            (
                "CREATE TABLE c (a int, FOREIGN KEY (a) REFERENCES p)",
                &["c", "p"],
            ),
            ("CREATE TABLE c () INHERITS (p)", &["c", "p"]),
            (
                "CREATE TABLE c PARTITION OF p FOR VALUES IN (1)",
                &["c", "p"],
            ),
            ("ALTER TABLE t RENAME TO u", &["t", "u"]),
            ("ALTER TABLE t ADD COLUMN b int", &["t"]),
            (
                "ALTER TABLE c ADD FOREIGN KEY (a) REFERENCES p",
                &["c", "p"],
            ),
            ("DROP TABLE a, s.b", &["a", "b"]),
            ("CREATE OR REPLACE VIEW v AS SELECT 1", &["v"]),
            (
                "CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
                &["f"],
            ),
            ("DROP FUNCTION f(int), g", &["f", "g"]),
            ("CREATE POLICY p ON t USING (true)", &["t"]),
            ("DROP POLICY p ON t", &["t"]),
            ("CREATE INDEX ON t (a)", &[]),
            ("GRANT SELECT ON t TO public", &[]),
        ];
        for (sql, names) in cases {
            assert_eq!(ddl(sql), Ddl::objects(names.iter().copied()), "{sql}");
        }
        for sql in [
            "DROP SCHEMA s CASCADE",
            "ALTER TABLE p ATTACH PARTITION c FOR VALUES IN (2)",
            "ALTER TABLE p DETACH PARTITION c",
            "DO $$ BEGIN END $$",
            "CREATE TABLE t (LIKE u)",
            "ALTER TABLE t SET SCHEMA s",
        ] {
            assert_eq!(ddl(sql), Ddl::All, "{sql}");
        }
        assert_eq!(ddl("SELECT 1"), Ddl::None);
        assert_eq!(ddl("UPDATE t SET a = 1"), Ddl::None);
    }
}

//! The model's prepared statements: a Parse stored or refused, a Describe
//! of one, a run of one resolved to what it runs.

use super::*;

impl Backend {
    /// A Parse: the statement stored under its name, or refused.
    pub(super) fn parse(&mut self, body: &[u8], out: &mut Vec<u8>) {
        let (name, body) = split_cstr(body);
        if name.is_empty() {
            // PostgreSQL drops the unnamed statement first.
            self.statement = None;
        }
        // Not a program's: what pgcache sends to be refused.
        let Some(sql) = Sql::of(&text(body)) else {
            return self.fail("42601", out);
        };
        if self.failed() {
            self.fail("25P02", out);
        } else if sql == Sql::Bad {
            self.fail("42703", out);
        } else if self.statements.contains_key(name) {
            let name = String::from_utf8_lossy(name);
            let message = format!("prepared statement \"{name}\" already exists");
            self.fail_saying("42P05", &message, out);
        } else {
            self.begin_implicit();
            match name.is_empty() {
                true => self.statement = Some(sql),
                false => _ = self.statements.insert(name.to_vec(), sql),
            }
            out.extend(frame(b'1', &[]));
        }
    }

    /// Statement `name` is not prepared: refused as PostgreSQL refuses it.
    pub(super) fn fail_missing(&mut self, name: &[u8], out: &mut Vec<u8>) {
        let message = match name.is_empty() {
            true => "unnamed prepared statement does not exist".to_owned(),
            false => format!(
                "prepared statement \"{}\" does not exist",
                String::from_utf8_lossy(name)
            ),
        };
        self.fail_saying("26000", &message, out);
    }

    /// A Describe of statement `body` names: its parameters (none) and
    /// its rows. A statement that returns rows is refused in a failed
    /// transaction, as PostgreSQL refuses it.
    pub(super) fn describe_statement(&mut self, body: &[u8], out: &mut Vec<u8>) {
        let (name, _) = split_cstr(body);
        let Some(sql) = self.prepared(name) else {
            return self.fail_missing(name, out);
        };
        if self.failed() && sql.is_read() {
            return self.fail("25P02", out);
        }
        out.extend(frame(b't', &[0, 0]));
        out.extend(match sql.is_read() {
            true => description(sql),
            false => frame(b'n', &[]),
        });
    }

    /// The statement prepared under `name` ("": the unnamed one).
    pub fn prepared(&self, name: &[u8]) -> Option<Sql> {
        match name.is_empty() {
            true => self.statement,
            false => self.statements.get(name).copied(),
        }
    }

    /// `step` with each run of a named statement given the statement
    /// prepared under that name now ([`Sql::Bad`] if none is: its Bind
    /// fails), so that what it runs is known.
    pub fn resolve(&self, step: &Step) -> Step {
        let Step::Batch(execs) = step else {
            return step.clone();
        };
        let resolved = execs.iter().map(|exec| match exec.named {
            Some(n) => Exec {
                sql: self.prepared(&statement_name(n)).unwrap_or(Sql::Bad),
                ..*exec
            },
            None => *exec,
        });
        Step::Batch(resolved.collect())
    }
}

/// A C string at the start of `body`, and what follows it.
pub(super) fn split_cstr(body: &[u8]) -> (&[u8], &[u8]) {
    let end = body.iter().position(|b| *b == 0).unwrap_or(body.len());
    (&body[..end], body.get(end + 1..).unwrap_or_default())
}

//! What a fresh login starts with: the settings query's answer, shared by
//! the sessions that log in alike.
//!
//! A session's first cacheable read asks its backend for every setting
//! (`pg_show_all_settings()`), which costs a fresh backend a few
//! milliseconds of catalog loading and formatting: a client that connects
//! for each request would pay it every time, and a burst of connections
//! queues behind it. Yet a fresh backend's settings follow from the login
//! (database, user, startup parameters) and from what lies outside the
//! session: the server's configuration (`pg_conf_load_time()` moves with
//! each reload and restart), recovery, and the role and database settings
//! (`pg_db_role_setting`). So a login's answer is kept with that
//! fingerprint, and the next session that logs in alike asks only for its
//! identity and the fingerprint (a fraction of the cost): the same, and it
//! adopts the kept answer; different, and it reads everything as before.
//! Only sessions still in their login state use it (nothing they ran may
//! have changed a setting).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use crate::cache::database::DbState;
use crate::pool::transaction::SettingsRow;
use crate::protocol::startup::Startup;
use crate::session::known::{FINGERPRINT_COLUMNS, ROLE_COLUMN};

/// The identity columns of the settings row the probe answers too.
const IDENTITY: [usize; 4] = [0, 1, 2, ROLE_COLUMN];

type Rows = Vec<Vec<Option<String>>>;

/// A login's settings answer, and what it depended on.
pub(super) struct Login {
    pub generation: u64,
    pub row: Arc<SettingsRow>,
    /// The fingerprint's rows, sorted.
    fingerprint: Rows,
}

impl Login {
    /// From the settings query's answer: `None` unless every row ends in
    /// the fingerprint after `columns` of the query's own.
    pub fn read(rows: &[Vec<Option<String>>], columns: usize) -> Option<Rows> {
        if rows.is_empty()
            || rows
                .iter()
                .any(|r| r.len() != columns + FINGERPRINT_COLUMNS)
        {
            return None;
        }
        Some(sorted_tails(rows, columns))
    }

    /// Whether the probe's answer shows the same identity and fingerprint.
    pub fn matches(&self, probe: &[Vec<Option<String>>]) -> bool {
        let columns = IDENTITY.len();
        let Some(first) = probe.first() else {
            return false;
        };
        probe
            .iter()
            .all(|r| r.len() == columns + FINGERPRINT_COLUMNS)
            && IDENTITY
                .iter()
                .zip(first)
                .all(|(&i, cell)| self.row.cells.get(i) == Some(cell))
            && sorted_tails(probe, columns) == self.fingerprint
    }
}

fn sorted_tails(rows: &[Vec<Option<String>>], columns: usize) -> Rows {
    let mut tails: Rows = rows.iter().map(|r| r[columns..].to_vec()).collect();
    tails.sort();
    tails
}

/// Bounds [`SharedLogins`]: past it the memo starts again.
const MAX_LOGINS: usize = 1024;

type LoginKey = (usize, Vec<(String, String)>);

/// The login's answer, and the database state it was read in.
type KeptLogin = (Weak<DbState>, Arc<Login>);

/// Logins' settings answers, by database state and startup parameters
/// (exactly: a login differing in any parameter is another).
#[derive(Default)]
pub struct SharedLogins {
    logins: Mutex<HashMap<LoginKey, KeptLogin>>,
}

impl SharedLogins {
    pub(super) fn get(&self, db: &Arc<DbState>, startup: &Startup) -> Option<Arc<Login>> {
        let logins = self.logins.lock().unwrap_or_else(|e| e.into_inner());
        let key = (Arc::as_ptr(db) as usize, startup.params.clone());
        let (owner, login) = logins.get(&key)?;
        (owner.strong_count() > 0).then(|| Arc::clone(login))
    }

    pub(super) fn put(
        &self,
        db: &Arc<DbState>,
        startup: &Startup,
        generation: u64,
        row: Arc<SettingsRow>,
        fingerprint: Rows,
    ) {
        let mut logins = self.logins.lock().unwrap_or_else(|e| e.into_inner());
        if logins.len() >= MAX_LOGINS {
            logins.clear();
        }
        let login = Login {
            generation,
            row,
            fingerprint,
        };
        logins.insert(
            (Arc::as_ptr(db) as usize, startup.params.clone()),
            (Arc::downgrade(db), Arc::new(login)),
        );
    }

    /// Forgets a login whose probe no longer matched.
    pub(super) fn forget(&self, db: &Arc<DbState>, startup: &Startup) {
        let mut logins = self.logins.lock().unwrap_or_else(|e| e.into_inner());
        logins.remove(&(Arc::as_ptr(db) as usize, startup.params.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A settings row's own columns: identity, isolation, everything,
    /// role, own settings.
    const SETTINGS: [&str; 6] = ["alice", "alice", "read committed", "a=b", "none", "{}"];

    /// Cells of `parts`, one after another.
    fn cells(parts: &[&[&str]]) -> Vec<Option<String>> {
        parts
            .iter()
            .flat_map(|p| p.iter())
            .map(|v| Some(v.to_string()))
            .collect()
    }

    #[test]
    fn a_probe_matches_only_the_same_identity_and_fingerprint_in_any_row_order() {
        let full = [
            cells(&[&SETTINGS, &["t0", "f", "5", "0", "{x=1}"]]),
            cells(&[&SETTINGS, &["t0", "f", "0", "10", "{y=2}"]]),
        ];
        let kept = Login {
            generation: 1,
            row: crate::session::known::settings_row(cells(&[&SETTINGS])),
            fingerprint: Login::read(&full, SETTINGS.len()).expect("the fingerprint"),
        };
        let probe = |user: &str, reload: &str, setting: &str| {
            let identity = [user, user, "read committed", "none", reload, "f"];
            vec![
                cells(&[&identity, &["0", "10", "{y=2}"]]),
                cells(&[&identity, &["5", "0", setting]]),
            ]
        };
        assert!(kept.matches(&probe("alice", "t0", "{x=1}")));
        assert!(!kept.matches(&probe("bob", "t0", "{x=1}")), "another user");
        assert!(!kept.matches(&probe("alice", "t1", "{x=1}")), "a reload");
        let changed = probe("alice", "t0", "{x=2}");
        assert!(!kept.matches(&changed), "ALTER ROLE SET");
        let gone = &probe("alice", "t0", "{x=1}")[..1];
        assert!(!kept.matches(gone), "a setting gone");
        assert!(!kept.matches(&[]), "no answer");
    }

    #[test]
    fn an_answer_without_the_fingerprint_is_not_kept() {
        let short = [cells(&[&SETTINGS])];
        assert!(Login::read(&short, SETTINGS.len()).is_none());
        assert!(Login::read(&[], SETTINGS.len()).is_none());
    }
}

//! What the disk tier carries across a restart: for each database, the
//! version counters its entries were keyed under and the replication slot
//! that holds every change made since. A restarted pgcache takes the
//! counters back and reads the slot from where the last one left off, so
//! an entry is served again only if nothing it read changed meanwhile
//! (DDL included: the event trigger's announcements are in the stream).
//!
//! Written once, when pgcache stops after draining its sessions and its
//! streams; taken (read and removed) at start. A pgcache killed before
//! writing it leaves none, and its successor starts the tier empty.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The file, beside the tree.
const FILE: &str = "pgcache-disk-v1.carry";
/// Bumped when what a counter means, or how keys are made of them, changes.
const FORMAT: u32 = 1;

/// Everything carried.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Carried {
    format: u32,
    pub databases: BTreeMap<String, CarriedDb>,
    /// Every file of the tree as the clean stop left it (path under the
    /// tree, xxh3 of its bytes): the tree trusts the lengths it reads, so
    /// a file changed since is never opened.
    #[serde(default)]
    pub files: BTreeMap<String, u64>,
}

/// One database's.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CarriedDb {
    /// The persistent slot whose stream applied every change the counters
    /// reflect.
    pub slot: String,
    /// Mixed into the database's disk keys (see [`super::DbState`]).
    pub nonce: u128,
    pub epoch: u64,
    /// Local counters by family name; absent ones were 0.
    pub families: Vec<(String, u64)>,
}

impl Carried {
    pub fn new(databases: BTreeMap<String, CarriedDb>) -> Self {
        Self {
            format: FORMAT,
            databases,
            files: BTreeMap::new(),
        }
    }

    /// Reads and removes the file in `dir`: `None` when there is none, or
    /// it is not this layout's (then it is removed too).
    pub fn take(dir: &Path) -> std::io::Result<Option<Carried>> {
        let path = dir.join(FILE);
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        std::fs::remove_file(&path)?;
        sync_dir(dir)?;
        Ok(serde_json::from_slice::<Carried>(&text)
            .ok()
            .filter(|c| c.format == FORMAT))
    }

    /// Writes the file in `dir` whole or not at all.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let path = dir.join(FILE);
        let partial = dir.join(format!("{FILE}.partial"));
        let mut file = std::fs::File::create(&partial)?;
        file.write_all(&serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        file.sync_all()?;
        std::fs::rename(&partial, &path)?;
        sync_dir(dir)
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_saved_is_taken_once() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Carried::take(dir.path()).unwrap(), None);
        let db = CarriedDb {
            slot: "pgcache_d1_2".into(),
            nonce: 7 << 100,
            epoch: 3,
            families: vec![("t".into(), 9), ("t#k4".into(), 2)],
        };
        let carried = Carried::new(BTreeMap::from([("app".to_owned(), db)]));
        carried.save(dir.path()).unwrap();
        assert_eq!(Carried::take(dir.path()).unwrap(), Some(carried));
        assert_eq!(Carried::take(dir.path()).unwrap(), None, "taken once");
        std::fs::write(
            dir.path().join(FILE),
            b"{\"format\": 99, \"databases\": {}}",
        )
        .unwrap();
        assert_eq!(Carried::take(dir.path()).unwrap(), None, "another layout");
        assert!(!dir.path().join(FILE).exists());
    }
}

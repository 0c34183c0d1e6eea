//! What PostgreSQL reports for a client's startup value: `DateStyle=iso,
//! mdy` is reported as `ISO, MDY`, `TimeZone=europe/paris` as
//! `Europe/Paris`, `IntervalStyle=POSTGRES` as `postgres`. Only the server
//! knows every setting's spelling (time zone names, say), so a pool learns
//! each value from a connection the first time a client gives it, and
//! greets the next clients with it without one.

use std::collections::HashMap;
use std::sync::Mutex;

/// Past this many values the memo starts again.
const MAX_VALUES: usize = 1024;

/// A setting's name and a value as a client gave it.
type Given = (Box<str>, Box<str>);

/// The values a pool's server reported, by setting and value as given.
#[derive(Default)]
pub struct Reported(Mutex<HashMap<Given, Box<str>>>);

impl Reported {
    /// How the server reports `value` of setting `name`, if learnt.
    pub fn get(&self, name: &str, value: &str) -> Option<String> {
        let values = self.0.lock().unwrap_or_else(|e| e.into_inner());
        values
            .get(&(Box::from(name), Box::from(value)))
            .map(|v| v.to_string())
    }

    /// The server reports `value` of setting `name` as `reported`.
    pub fn learn(&self, name: &str, value: &str, reported: &str) {
        let mut values = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if values.len() >= MAX_VALUES {
            values.clear();
        }
        values.insert((name.into(), value.into()), reported.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_learnt_by_setting_and_spelling() {
        let reported = Reported::default();
        assert_eq!(reported.get("DateStyle", "iso, mdy"), None);
        reported.learn("DateStyle", "iso, mdy", "ISO, MDY");
        assert_eq!(
            reported.get("DateStyle", "iso, mdy").as_deref(),
            Some("ISO, MDY")
        );
        assert_eq!(reported.get("DateStyle", "ISO,MDY"), None);
        assert_eq!(reported.get("TimeZone", "iso, mdy"), None);
        for n in 0..MAX_VALUES {
            reported.learn("TimeZone", &n.to_string(), "x");
        }
        assert!(reported.0.lock().unwrap().len() <= MAX_VALUES, "bounded");
    }
}

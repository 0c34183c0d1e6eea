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

/// What the server reports for each value of one setting, by the value as
/// a client gave it.
type Values = HashMap<Box<str>, Box<str>>;

/// The values a pool's server reported, by setting.
#[derive(Default)]
pub struct Reported(Mutex<HashMap<Box<str>, Values>>);

impl Reported {
    /// How the server reports `value` of setting `name`, if learnt.
    pub fn get(&self, name: &str, value: &str) -> Option<String> {
        let settings = self.0.lock().unwrap_or_else(|e| e.into_inner());
        settings.get(name)?.get(value).map(|v| v.to_string())
    }

    /// Whether the pool learnt `value` of setting `name`.
    pub fn knows(&self, name: &str, value: &str) -> bool {
        let settings = self.0.lock().unwrap_or_else(|e| e.into_inner());
        settings
            .get(name)
            .is_some_and(|values| values.contains_key(value))
    }

    /// The server reports `value` of setting `name` as `reported`.
    pub fn learn(&self, name: &str, value: &str, reported: &str) {
        let mut settings = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if settings.values().map(Values::len).sum::<usize>() >= MAX_VALUES {
            settings.clear();
        }
        settings
            .entry(name.into())
            .or_default()
            .insert(value.into(), reported.into());
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
        let total: usize = reported.0.lock().unwrap().values().map(HashMap::len).sum();
        assert!(total <= MAX_VALUES, "bounded");
        assert!(reported.knows("TimeZone", &(MAX_VALUES - 1).to_string()));
    }
}

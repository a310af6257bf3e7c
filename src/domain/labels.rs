//! An operation's labels: a few key-value pairs its caller sets when it
//! asks (a CSI controller's cluster, PV and namespace), kept with the
//! operation, never changed, part of the request's fingerprint, and what
//! lists filter on. Bounded as River's tags are: a strict character class
//! and length, so that they stay what they are for (finding a fleet's
//! operations), not a store of data. Not for secrets: operators, logs and
//! the reconcile log read them.

use std::collections::BTreeMap;
use std::fmt;

use super::validate::InvalidField;

/// At most this many labels on an operation (and in a filter).
pub const MAX_LABELS: usize = 8;

/// The longest key name (and key prefix), in characters.
pub const MAX_KEY_PART: usize = 63;

/// The longest value, in characters.
pub const MAX_VALUE: usize = 255;

/// Labels, checked: at most [`MAX_LABELS`], each key
/// `[prefix/]name` where the prefix and the name are 1..=63 of
/// `[a-z0-9_.-]` starting with `[a-z0-9]`, each value up to 255 printable
/// characters. Ordered by key (how they are compared, stored and shown).
///
/// Boxed, and none when empty: an operation (thousands wait at once, each
/// in a task's future) carries a pointer, whatever its labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
#[allow(
    clippy::box_collection,
    reason = "a pointer's room in each of thousands of waiting operations, not a map's three words"
)]
pub struct Labels(Option<Box<BTreeMap<String, String>>>);

/// The map of no labels.
static NONE: BTreeMap<String, String> = BTreeMap::new();

impl Labels {
    /// No labels.
    pub const fn none() -> Self {
        Self(None)
    }

    fn of(map: BTreeMap<String, String>) -> Self {
        Self((!map.is_empty()).then(|| Box::new(map)))
    }

    /// `pairs` checked as the labels of `field` (`labels`, or a filter's
    /// `filter.labels`): `INVALID_ARGUMENT` names the field and the key.
    pub fn parse<K, V>(
        field: &'static str,
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, InvalidField>
    where
        K: Into<String>,
        V: Into<String>,
    {
        let mut map = BTreeMap::new();
        for (k, v) in pairs {
            let (k, v) = (k.into(), v.into());
            check_key(&k)
                .map_err(|why| InvalidField::new(field, format!("key {:?}: {why}", shorten(&k))))?;
            check_value(&v).map_err(|why| InvalidField::new(field, format!("{k:?}: {why}")))?;
            map.insert(k, v);
        }
        if map.len() > MAX_LABELS {
            return Err(InvalidField::new(
                field,
                format!("{} labels; at most {MAX_LABELS}", map.len()),
            ));
        }
        Ok(Self::of(map))
    }

    /// Labels read back from the ledger (written checked: not checked
    /// again, so that a row stays readable whatever version wrote it).
    pub fn from_stored(map: BTreeMap<String, String>) -> Self {
        Self::of(map)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn len(&self) -> usize {
        self.as_map().len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.as_map().iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.as_map().get(key).map(String::as_str)
    }

    pub fn as_map(&self) -> &BTreeMap<String, String> {
        self.0.as_deref().unwrap_or(&NONE)
    }

    /// Whether every label of `wanted` is among these, with its value.
    pub fn contains_all(&self, wanted: &Labels) -> bool {
        wanted.iter().all(|(k, v)| self.get(k) == Some(v))
    }

    /// As JSON (an object, keys in order): how both ledgers store them,
    /// and part of a request's fingerprint.
    pub fn to_json(&self) -> String {
        // A map of strings always serializes.
        serde_json::to_string(self.as_map()).unwrap_or_default()
    }
}

impl fmt::Display for Labels {
    /// `k=v,k2=v2`, keys in order (the reconcile log's `labels`, and
    /// `ops` tables); the PostgreSQL log renders them so too.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (k, v)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{k}={v}")?;
        }
        Ok(())
    }
}

/// A key as echoed in an error: a long one cut, never whole.
fn shorten(k: &str) -> String {
    if k.chars().count() > 80 {
        format!("{}…", k.chars().take(80).collect::<String>())
    } else {
        k.to_string()
    }
}

fn check_part(part: &str, what: &str) -> Result<(), String> {
    let n = part.chars().count();
    if n == 0 {
        return Err(format!("the {what} is empty"));
    }
    if n > MAX_KEY_PART {
        return Err(format!(
            "the {what} is {n} characters long; at most {MAX_KEY_PART}"
        ));
    }
    let first = part.as_bytes()[0];
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return Err(format!("the {what} must start with a-z or 0-9"));
    }
    if let Some(c) = part
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '.' | '-')))
    {
        return Err(format!(
            "the {what} has {c:?}; only a-z, 0-9, '_', '.' and '-' are allowed"
        ));
    }
    Ok(())
}

/// `[prefix/]name`, each part 1..=63 of `[a-z0-9_.-]` from `[a-z0-9]`.
fn check_key(k: &str) -> Result<(), String> {
    match k.split_once('/') {
        Some((prefix, name)) => {
            check_part(prefix, "prefix")?;
            check_part(name, "name")
        }
        None => check_part(k, "name"),
    }
}

fn check_value(v: &str) -> Result<(), String> {
    let n = v.chars().count();
    if n > MAX_VALUE {
        return Err(format!(
            "the value is {n} characters long; at most {MAX_VALUE}"
        ));
    }
    if let Some(c) = v.chars().find(|c| c.is_control()) {
        return Err(format!(
            "the value contains the control character {c:?}; only printable characters are allowed"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<Labels, InvalidField> {
        Labels::parse("labels", pairs.iter().map(|(k, v)| (*k, *v)))
    }

    #[test]
    fn keys_follow_the_character_class_with_an_optional_prefix() {
        for ok in [
            "pv",
            "cluster",
            "csi.k8s.io/pv",
            "0-a_b.c",
            "a/b",
            &"k".repeat(63),
        ] {
            assert!(parse(&[(ok, "v")]).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "PV",
            "-pv",
            "_pv",
            ".pv",
            "a b",
            "a/",
            "/a",
            "a/b/c",
            "ä",
            "a\0",
            &"k".repeat(64),
        ] {
            let e = parse(&[(bad, "v")]).unwrap_err();
            assert_eq!(e.field, "labels", "{bad}");
            assert!(e.reason.starts_with("key "), "{bad}: {}", e.reason);
        }
    }

    #[test]
    fn values_are_printable_and_bounded_and_labels_few() {
        assert!(parse(&[("k", "")]).is_ok());
        assert!(parse(&[("k", "Persistent Volume ü")]).is_ok());
        assert!(parse(&[("k", &"v".repeat(255))]).is_ok());
        let e = parse(&[("k", &"v".repeat(256))]).unwrap_err();
        assert!(e.reason.contains("\"k\""), "names the key: {}", e.reason);
        assert!(parse(&[("k", "a\nb")]).is_err());
        let eight: Vec<(String, &str)> = (0..8).map(|i| (format!("k{i}"), "v")).collect();
        assert!(Labels::parse("labels", eight.clone()).is_ok());
        let mut nine = eight;
        nine.push(("k8".into(), "v"));
        assert!(Labels::parse("labels", nine).is_err());
    }

    #[test]
    fn labels_show_and_store_in_key_order() {
        let l = parse(&[("zone", "a"), ("csi.k8s.io/pv", "pv-1")]).unwrap();
        assert_eq!(l.to_string(), "csi.k8s.io/pv=pv-1,zone=a");
        assert_eq!(l.to_json(), r#"{"csi.k8s.io/pv":"pv-1","zone":"a"}"#);
        assert!(l.contains_all(&parse(&[("zone", "a")]).unwrap()));
        assert!(!l.contains_all(&parse(&[("zone", "b")]).unwrap()));
        assert!(l.contains_all(&Labels::none()));
    }
}

//! Newtypes made only by parsing. A request that fails here gets
//! `INVALID_ARGUMENT` naming the field; nothing deeper sees an unchecked
//! string.

use std::fmt;

use uuid::Uuid;

/// A field that failed validation, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InvalidField {
    pub field: &'static str,
    pub reason: String,
}

impl InvalidField {
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

/// Parses a UUID in its canonical hyphenated form (Nova's `format: uuid`).
pub fn parse_uuid(field: &'static str, value: &str) -> Result<Uuid, InvalidField> {
    if value.is_empty() {
        return Err(InvalidField::new(field, "is required"));
    }
    if value.len() != 36 {
        return Err(InvalidField::new(
            field,
            format!("must be a UUID like 7ebed2ce-85b3-40b5-84ae-8cc725c37ed2, got {value:?}"),
        ));
    }
    Uuid::parse_str(value)
        .map_err(|e| InvalidField::new(field, format!("{value:?} is not a UUID: {e}")))
}

/// 1..=255 bytes of printable characters (no control characters).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub const MAX_LEN: usize = 255;

    pub fn parse(value: &str) -> Result<Self, InvalidField> {
        const FIELD: &str = "idempotency_key";
        if value.is_empty() {
            return Err(InvalidField::new(
                FIELD,
                "is required (1..255 printable characters)",
            ));
        }
        if value.len() > Self::MAX_LEN {
            return Err(InvalidField::new(
                FIELD,
                format!(
                    "is {} bytes long; the limit is {}",
                    value.len(),
                    Self::MAX_LEN
                ),
            ));
        }
        if let Some(c) = value.chars().find(|c| c.is_control()) {
            return Err(InvalidField::new(
                FIELD,
                format!(
                    "contains the control character {c:?}; only printable characters are allowed"
                ),
            ));
        }
        Ok(Self(value.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl IdempotencyKey {
    /// What the ledger knows this key by for `caller` (`KeyHash::of`).
    pub fn hash_for(&self, caller: Option<&str>) -> KeyHash {
        KeyHash::of(caller, &self.0)
    }
}

/// What the ledger knows a caller's key by: 16 bytes of SHA-256 of the
/// caller's length in bytes, `:`, the caller ('' for none) and the key
/// (the length keeps ("ab", "c") and ("a", "bc") apart). Keys are unique
/// per caller by it (`operations_key`), and a pruned key's tombstone is
/// found by it.
///
/// `of` is the only computation of it in the service: the stores bind it
/// (PostgreSQL as a UUID, SQLite as 16 bytes). PostgreSQL also has it as
/// an SQL function (`volume_reconciler_key_hash`, since the migration that
/// added tombstones), which must stay: a trigger fills the column with it
/// for writers that leave it out (the previous release, during a rolling
/// upgrade). `tests/store/upgrade.rs` holds the two equal for rows of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyHash([u8; 16]);

impl KeyHash {
    /// The hash of `caller`'s `key`.
    pub fn of(caller: Option<&str>, key: &str) -> Self {
        let caller = caller.unwrap_or("");
        let input = format!("{}:{caller}{key}", caller.len());
        let digest = ring::digest::digest(&ring::digest::SHA256, input.as_bytes());
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest.as_ref()[..16]);
        Self(out)
    }

    /// A hash no caller's key can have, for `tag` and `id`: an Ensure
    /// operation's (it has no key) and a key retired by a replay that
    /// started a new operation under it. Its input begins with `!`, and
    /// every key's with its caller's length in decimal: the two never meet.
    pub fn unkeyed(tag: &str, id: Uuid) -> Self {
        let input = format!("!{tag}:{id}");
        let digest = ring::digest::digest(&ring::digest::SHA256, input.as_bytes());
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest.as_ref()[..16]);
        Self(out)
    }

    /// Its 16 bytes (SQLite's `BLOB`).
    pub fn bytes(self) -> [u8; 16] {
        self.0
    }

    /// As a UUID (PostgreSQL's `uuid` column).
    pub fn uuid(self) -> Uuid {
        Uuid::from_bytes(self.0)
    }
}

/// A device path in the shape Nova accepts:
/// `^(/dev/x{0,1}[a-z]{0,1}d{0,1})([a-z]+)[0-9]*$`, which reduces to
/// `/dev/` followed by lowercase letters and then optional digits, and no
/// longer than the column Nova keeps it in (`device_name`, 255).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePath(String);

impl DevicePath {
    /// Nova's block-device-mapping column holds this many characters.
    pub const MAX_LEN: usize = 255;

    pub fn parse(value: &str) -> Result<Self, InvalidField> {
        const FIELD: &str = "device";
        // Counted before the shape: a huge value is not echoed back whole.
        let n = value.chars().count();
        if n > Self::MAX_LEN {
            return Err(InvalidField::new(
                FIELD,
                format!(
                    "is {n} characters long; Nova keeps at most {} (a path like /dev/vdb)",
                    Self::MAX_LEN
                ),
            ));
        }
        let bad = || {
            InvalidField::new(
                FIELD,
                format!(
                    "{value:?} is not a device path like /dev/vdb (/dev/ + lowercase letters + optional digits)"
                ),
            )
        };
        let rest = value.strip_prefix("/dev/").ok_or_else(bad)?;
        let letters = rest.bytes().take_while(|b| b.is_ascii_lowercase()).count();
        if letters == 0 || !rest[letters..].bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        Ok(Self(value.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A Nova device tag: 1..=60 characters, no ',' or '/'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tag(String);

impl Tag {
    pub fn parse(value: &str) -> Result<Self, InvalidField> {
        const FIELD: &str = "tag";
        let n = value.chars().count();
        if n == 0 || n > 60 {
            return Err(InvalidField::new(
                FIELD,
                format!("must be 1..60 characters, got {n}"),
            ));
        }
        if value.contains(',') || value.contains('/') || value.chars().any(|c| c.is_control()) {
            return Err(InvalidField::new(
                FIELD,
                "must not contain ',', '/' or control characters",
            ));
        }
        Ok(Self(value.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_paths_follow_novas_pattern() {
        for ok in ["/dev/vdb", "/dev/sda1", "/dev/xvdc", "/dev/hdz12"] {
            assert!(DevicePath::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "vdb",
            "/dev/",
            "/dev/VDB",
            "/dev/vd-b",
            "/dev/1",
            "/dev/vdb1x",
            "/dev/vdb/..",
        ] {
            let e = DevicePath::parse(bad).unwrap_err();
            assert_eq!(e.field, "device", "{bad}");
        }
    }

    #[test]
    fn device_paths_fit_novas_column() {
        let longest = format!("/dev/vd{}", "b".repeat(DevicePath::MAX_LEN - 7));
        assert_eq!(longest.len(), 255);
        assert!(DevicePath::parse(&longest).is_ok());
        let e = DevicePath::parse(&format!("/dev/vd{}", "b".repeat(300))).unwrap_err();
        assert_eq!(e.field, "device");
        assert!(e.reason.contains("307 characters"), "{}", e.reason);
        assert!(e.reason.contains("255"), "{}", e.reason);
    }

    #[test]
    fn keys_are_one_to_255_printable_bytes() {
        assert!(IdempotencyKey::parse("a").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(256)).is_err());
        assert!(IdempotencyKey::parse("").is_err());
        assert!(IdempotencyKey::parse("a\nb").is_err());
        assert!(IdempotencyKey::parse("schlüssel-ß").is_ok());
    }

    /// The bytes PostgreSQL's `volume_reconciler_key_hash` computes for the
    /// same pairs (and the length prefix keeps concatenations apart).
    #[test]
    fn a_key_hash_is_sha256_of_the_callers_length_caller_and_key() {
        for (caller, key, expected) in [
            (None, "k", "d324e944-2c80-819d-1c85-c51c5c90a562"),
            (Some(""), "k", "d324e944-2c80-819d-1c85-c51c5c90a562"),
            (Some("ci"), "tok-1", "8b802ff0-65e2-8f9f-59e8-4ed893fd30ce"),
            (Some("ab"), "c", "74493170-2c0c-cc82-06b2-65f934aba523"),
            (Some("a"), "bc", "fac4d752-82e3-de35-8e8a-42f2e1166bfe"),
        ] {
            assert_eq!(
                KeyHash::of(caller, key).uuid().to_string(),
                expected,
                "{caller:?} {key:?}"
            );
        }
        let key = IdempotencyKey::parse("tok-1").unwrap();
        assert_eq!(key.hash_for(Some("ci")), KeyHash::of(Some("ci"), "tok-1"));
    }

    #[test]
    fn uuids_must_be_canonical() {
        assert!(parse_uuid("server_id", "7ebed2ce-85b3-40b5-84ae-8cc725c37ed2").is_ok());
        assert_eq!(parse_uuid("server_id", "").unwrap_err().field, "server_id");
        assert!(parse_uuid("volume_id", "7ebed2ce85b340b584ae8cc725c37ed2").is_err());
        assert!(parse_uuid("volume_id", "not-a-uuid-not-a-uuid-not-a-uuid-xx").is_err());
    }

    #[test]
    fn tags_follow_novas_rules() {
        assert!(Tag::parse("foo").is_ok());
        assert!(Tag::parse(&"t".repeat(61)).is_err());
        assert!(Tag::parse("a/b").is_err());
        assert!(Tag::parse("a,b").is_err());
    }
}

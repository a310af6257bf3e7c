//! Who asked, and what the ledger knows an operation by: one type each,
//! from the gRPC edge down to the store (rule 1), so that "no caller" is
//! spelled one way ([`Caller::ANONYMOUS`]) and a key never travels without
//! its caller.

use std::fmt;

use uuid::Uuid;

use super::validate::{IdempotencyKey, InvalidField, KeyHash};

/// Who asked for an operation: a token's name, or a client certificate's
/// identity (`CN#hash`); [`Caller::ANONYMOUS`] when the service
/// authenticates nobody. Keys, reads and joins are per caller.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Caller(String);

impl Caller {
    /// The one caller of a service without authentication.
    pub const ANONYMOUS: Caller = Caller(String::new());

    /// The caller of that name (`""`: anonymous).
    pub fn named(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    /// The caller a ledger row names (`None`: anonymous).
    pub fn of_row(caller: Option<&str>) -> Self {
        Self(caller.unwrap_or("").to_string())
    }

    /// Its name; `None` for the anonymous caller (the ledger's NULL).
    pub fn name(&self) -> Option<&str> {
        (!self.0.is_empty()).then_some(self.0.as_str())
    }

    /// Its name, `""` for the anonymous caller (how keys are hashed and
    /// how a filter names "the callers without a name").
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_anonymous(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<&str> for Caller {
    fn from(name: &str) -> Self {
        Self::named(name)
    }
}

impl fmt::Display for Caller {
    /// Its name, or `-` for the anonymous caller (logs and events).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "-" } else { &self.0 })
    }
}

/// A caller's idempotency key: what a keyed operation is known by. Keys
/// are unique per caller, never across callers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallerKey {
    caller: Caller,
    key: IdempotencyKey,
}

impl CallerKey {
    pub fn new(caller: Caller, key: IdempotencyKey) -> Self {
        Self { caller, key }
    }

    /// `caller`'s `key`, the key checked as at the edge (tools and tests).
    pub fn parse(caller: Option<&str>, key: &str) -> Result<Self, InvalidField> {
        Ok(Self::new(
            Caller::of_row(caller),
            IdempotencyKey::parse(key)?,
        ))
    }

    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// What the ledger indexes it by (the one computation of it).
    pub fn hash(&self) -> KeyHash {
        KeyHash::of(self.caller.name(), self.key.as_str())
    }
}

/// What a new operation is known by: a caller's key (AttachVolume,
/// DetachVolume), or its identity alone (EnsureAttached, EnsureDetached:
/// no key; the open operation of the same caller, server, volume and
/// action is joined instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpKey {
    Keyed(CallerKey),
    Ensure(Caller),
}

impl OpKey {
    pub fn caller(&self) -> &Caller {
        match self {
            OpKey::Keyed(k) => k.caller(),
            OpKey::Ensure(c) => c,
        }
    }

    pub fn is_ensure(&self) -> bool {
        matches!(self, OpKey::Ensure(_))
    }

    /// The key as the ledger's `idempotency_key` holds it: the caller's,
    /// or for an Ensure call the operation's id (a column every row fills;
    /// the API shows an Ensure operation's key empty).
    pub fn stored_key(&self, id: Uuid) -> String {
        match self {
            OpKey::Keyed(k) => k.key().as_str().to_string(),
            OpKey::Ensure(_) => id.to_string(),
        }
    }

    /// The hash the ledger keeps it unique by: the caller's key's, or for
    /// an Ensure call one no caller's key can have ([`KeyHash::unkeyed`]).
    pub fn hash(&self, id: Uuid) -> KeyHash {
        match self {
            OpKey::Keyed(k) => k.hash(),
            OpKey::Ensure(_) => KeyHash::unkeyed("ensure", id),
        }
    }

    /// The caller's key, for a keyed operation.
    pub fn keyed(&self) -> Option<&CallerKey> {
        match self {
            OpKey::Keyed(k) => Some(k),
            OpKey::Ensure(_) => None,
        }
    }
}

impl From<CallerKey> for OpKey {
    fn from(k: CallerKey) -> Self {
        OpKey::Keyed(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_caller_is_spelled_one_way() {
        assert_eq!(Caller::of_row(None), Caller::ANONYMOUS);
        assert_eq!(Caller::of_row(Some("")), Caller::ANONYMOUS);
        assert_eq!(Caller::named(""), Caller::ANONYMOUS);
        assert_eq!(Caller::ANONYMOUS.name(), None);
        assert_eq!(Caller::ANONYMOUS.to_string(), "-");
        assert_eq!(Caller::named("ci").name(), Some("ci"));
    }

    #[test]
    fn an_ensure_operations_hash_is_no_callers_keys() {
        let id = Uuid::now_v7();
        let ensure = OpKey::Ensure(Caller::ANONYMOUS);
        let same_text = CallerKey::parse(None, &id.to_string()).unwrap();
        assert_ne!(ensure.hash(id), same_text.hash());
        assert_eq!(ensure.stored_key(id), id.to_string());
        assert_eq!(
            OpKey::from(same_text.clone()).hash(id),
            KeyHash::of(None, &id.to_string())
        );
    }
}

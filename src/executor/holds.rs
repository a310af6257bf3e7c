//! The leases this replica holds: an operation's id is held while an
//! executor run or a reconciler pass works on it, and the heartbeat
//! (`Executor::heartbeat`) renews every held lease. A holder that dies
//! stops renewing, and its leases lapse within one lease duration.
//!
//! Each hold also knows until when its lease is known to hold, on this
//! replica's monotonic clock: a renewal sent at `t` that came back keeps
//! the lease at least until `t + lease` (the database set its expiry after
//! the statement left). A request may leave only before that (see
//! `Executor`'s send gate): after it, another replica may have taken the
//! operation over.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
use uuid::Uuid;

#[derive(Debug, Default)]
struct Held {
    /// Holders (a pass may run while a re-send it started holds the same
    /// operation).
    holders: usize,
    /// Until when the lease is known to hold; `None`: not known here.
    confirmed_until: Option<Instant>,
}

#[derive(Default, Clone)]
pub struct Holds(Arc<Mutex<HashMap<Uuid, Held>>>);

/// Holds one operation's lease until dropped.
pub struct Hold {
    holds: Holds,
    id: Uuid,
}

impl Holds {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Held>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn hold(&self, id: Uuid) -> Hold {
        self.map().entry(id).or_default().holders += 1;
        Hold {
            holds: self.clone(),
            id,
        }
    }

    pub fn ids(&self) -> Vec<Uuid> {
        self.map().keys().copied().collect()
    }

    /// The leases of `ids` (those still held) hold until at least `until`.
    pub fn confirm(&self, ids: &[Uuid], until: Instant) {
        let mut map = self.map();
        for id in ids {
            if let Some(h) = map.get_mut(id) {
                h.confirmed_until = Some(h.confirmed_until.map_or(until, |u| u.max(until)));
            }
        }
    }

    /// Until when `id`'s lease is known to hold.
    pub fn confirmed_until(&self, id: Uuid) -> Option<Instant> {
        self.map().get(&id).and_then(|h| h.confirmed_until)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut map = self.holds.map();
        if let Some(h) = map.get_mut(&self.id) {
            h.holders -= 1;
            if h.holders == 0 {
                map.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_held_while_any_holder_lives() {
        let holds = Holds::default();
        let id = Uuid::new_v4();
        let a = holds.hold(id);
        let b = holds.hold(id);
        assert_eq!(holds.ids(), vec![id]);
        drop(a);
        assert_eq!(holds.ids(), vec![id]);
        drop(b);
        assert!(holds.ids().is_empty());
    }

    #[test]
    fn a_confirmation_only_extends_a_held_lease() {
        let holds = Holds::default();
        let (id, other) = (Uuid::new_v4(), Uuid::new_v4());
        let now = Instant::now();
        let h = holds.hold(id);
        assert_eq!(holds.confirmed_until(id), None);
        holds.confirm(&[id, other], now + std::time::Duration::from_secs(3));
        holds.confirm(&[id], now + std::time::Duration::from_secs(1));
        assert_eq!(
            holds.confirmed_until(id),
            Some(now + std::time::Duration::from_secs(3))
        );
        assert_eq!(holds.confirmed_until(other), None, "not held: not kept");
        drop(h);
        assert_eq!(holds.confirmed_until(id), None);
    }
}

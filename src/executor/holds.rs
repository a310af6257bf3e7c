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
//!
//! A hold knows its lease's epoch, and renewals name it: a lease whose
//! epoch moved on is lost even if its owner's name is still this
//! replica's. A lease found lost trips the hold's `lost` token, and the
//! run working on it stops at once (`Executor::drive`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::store::HeldLease;

#[derive(Debug, Default)]
struct Held {
    /// Holders (a pass may run while a re-send it started holds the same
    /// operation).
    holders: usize,
    /// The epoch the lease is held under; `None` while its intent is
    /// being written (held already, so that nothing releases or claims
    /// it meanwhile, but nothing to renew yet).
    epoch: Option<i64>,
    /// Until when the lease is known to hold; `None`: not known here.
    confirmed_until: Option<Instant>,
    /// Tripped when the lease is found lost (a renewal, the send gate or a
    /// fenced write found another holder or a decision): whoever works on
    /// the operation here stops.
    lost: CancellationToken,
    /// The last attempt (its count) whose request the send gate let out
    /// here: a later attempt recorded but never let out never left.
    departed: Option<i32>,
}

#[derive(Default, Clone)]
pub struct Holds(Arc<Mutex<HashMap<Uuid, Held>>>);

/// Holds one operation's lease until dropped.
pub struct Hold {
    holds: Holds,
    id: Uuid,
}

impl Hold {
    /// The epoch is known now (the intent was written, or read back).
    pub fn known(&self, epoch: i64) {
        if let Some(h) = self.holds.map().get_mut(&self.id) {
            h.epoch = Some(epoch);
        }
    }
}

impl Holds {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Held>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `id` under `epoch` (`None`: an intent still being written).
    /// A hold under a newer epoch than the one held (never while a task
    /// here works on the older: the claim passes over held operations)
    /// starts afresh.
    pub fn hold(&self, id: Uuid, epoch: Option<i64>) -> Hold {
        let mut map = self.map();
        let h = map.entry(id).or_default();
        if let (Some(new), Some(old)) = (epoch, h.epoch)
            && new > old
        {
            h.confirmed_until = None;
            h.lost = CancellationToken::new();
        }
        if epoch.is_some() {
            h.epoch = epoch.max(h.epoch);
        }
        h.holders += 1;
        Hold {
            holds: self.clone(),
            id,
        }
    }

    /// Every id held, intents being written included (what a claim passes
    /// over and a shutdown keeps).
    pub fn ids(&self) -> Vec<Uuid> {
        self.map().keys().copied().collect()
    }

    /// The leases to renew: those held under a known epoch and not lost.
    pub fn leases(&self) -> Vec<HeldLease> {
        self.map()
            .iter()
            .filter(|(_, h)| !h.lost.is_cancelled())
            .filter_map(|(id, h)| h.epoch.map(|epoch| HeldLease { id: *id, epoch }))
            .collect()
    }

    /// The lease `id` is held under, if its epoch is known.
    pub fn lease(&self, id: Uuid) -> Option<HeldLease> {
        self.map()
            .get(&id)
            .and_then(|h| h.epoch.map(|epoch| HeldLease { id, epoch }))
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

    /// `lease` was found lost: its holders here are told (if it is still
    /// held under that epoch), and nothing confirms it any more. True when
    /// this is news.
    pub fn lose(&self, lease: HeldLease) -> bool {
        let mut map = self.map();
        match map.get_mut(&lease.id) {
            Some(h) if h.epoch == Some(lease.epoch) && !h.lost.is_cancelled() => {
                h.confirmed_until = None;
                h.lost.cancel();
                true
            }
            _ => false,
        }
    }

    /// The request of attempt `attempt` of `id` is leaving (its send gate
    /// let it out).
    pub fn depart(&self, id: Uuid, attempt: i32) {
        if let Some(h) = self.map().get_mut(&id) {
            h.departed = h.departed.max(Some(attempt));
        }
    }

    /// The last attempt of `id` whose request the send gate let out here.
    pub fn departed(&self, id: Uuid) -> Option<i32> {
        self.map().get(&id).and_then(|h| h.departed)
    }

    /// Fires when `id`'s lease is found lost; `None` when it is not held.
    pub fn lost(&self, id: Uuid) -> Option<CancellationToken> {
        self.map().get(&id).map(|h| h.lost.clone())
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
        let a = holds.hold(id, Some(1));
        let b = holds.hold(id, Some(1));
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
        let h = holds.hold(id, Some(1));
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

    #[test]
    fn a_lease_is_lost_only_under_the_epoch_it_is_held_with() {
        let holds = Holds::default();
        let id = Uuid::new_v4();
        let writing = holds.hold(id, None);
        assert!(
            holds.leases().is_empty(),
            "an intent being written is not renewed"
        );
        assert_eq!(holds.ids(), vec![id], "but it is held");
        writing.known(4);
        let lost = holds.lost(id).unwrap();
        assert!(!holds.lose(HeldLease { id, epoch: 3 }), "an older epoch");
        assert!(!lost.is_cancelled());
        holds.confirm(&[id], Instant::now() + std::time::Duration::from_secs(3));
        assert!(holds.lose(HeldLease { id, epoch: 4 }));
        assert!(lost.is_cancelled());
        assert_eq!(
            holds.confirmed_until(id),
            None,
            "nothing confirms a lost lease"
        );
        assert!(holds.leases().is_empty(), "a lost lease is not renewed");
        assert!(!holds.lose(HeldLease { id, epoch: 4 }), "told once");
    }
}

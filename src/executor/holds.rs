//! The leases this replica holds: an operation's id is held while an
//! executor run or a reconciler pass works on it, and the heartbeat
//! (`Executor::heartbeat`) renews every held lease. A holder that dies
//! stops renewing, and its leases lapse within one lease duration.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

/// The ids held, each with how many holders (a pass may run while a
/// re-send it started holds the same operation).
#[derive(Default, Clone)]
pub struct Holds(Arc<Mutex<HashMap<Uuid, usize>>>);

/// Holds one operation's lease until dropped.
pub struct Hold {
    holds: Holds,
    id: Uuid,
}

impl Holds {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn hold(&self, id: Uuid) -> Hold {
        *self.map().entry(id).or_default() += 1;
        Hold {
            holds: self.clone(),
            id,
        }
    }

    pub fn ids(&self) -> Vec<Uuid> {
        self.map().keys().copied().collect()
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut map = self.holds.map();
        if let Some(n) = map.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
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
}

//! Nova's request slots (the per-host cap), shared fairly by callers when
//! they are contended: each request waits in its caller row's queue (the
//! caller table's, `--caller-quotas`; a request of no caller's, a look of
//! the reconciler, waits in the last row's, the default row's), and a
//! slot that frees goes to the row with waiters that holds the fewest
//! slots for its weight (`nova-share`). Uncontended, any request takes a
//! free slot at once: a row's weight bounds nothing while others leave
//! slots unused. So a caller flooding Nova with requests cannot keep
//! another's waiting behind its queue: under contention each row gets its
//! weight's share of the slots.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The slots and their waiters.
pub(crate) struct FairSlots {
    state: Mutex<State>,
    total: usize,
}

struct State {
    free: usize,
    weights: Vec<u32>,
    in_use: Vec<usize>,
    waiting: Vec<VecDeque<(u64, oneshot::Sender<Slot>)>>,
    next_ticket: u64,
}

/// A slot held; given back when dropped.
pub(crate) struct Slot {
    slots: Arc<FairSlots>,
    row: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.release(self.row);
    }
}

impl FairSlots {
    /// `total` slots, shared by one row (until `set_weights`).
    pub(crate) fn new(total: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                free: total,
                weights: vec![1],
                in_use: vec![0],
                waiting: vec![VecDeque::new()],
                next_ticket: 0,
            }),
            total,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the counts stay
        // consistent (each change is made whole under the lock).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The rows' weights, by index (before any request is sent).
    pub(crate) fn set_weights(&self, weights: Vec<u32>) {
        let mut s = self.lock();
        let n = weights.len().max(1);
        s.weights = weights.into_iter().map(|w| w.max(1)).collect();
        s.weights.resize(n, 1);
        s.in_use.resize(n, 0);
        s.waiting.resize_with(n, VecDeque::new);
    }

    /// Slots held now.
    pub(crate) fn in_use(&self) -> usize {
        self.total - self.lock().free
    }

    /// A slot for a request of `row` (`None`: the last row), waited for
    /// in turn; cancel-safe (a waiter dropped leaves its place, and a slot
    /// granted to it goes to the next).
    pub(crate) async fn acquire(self: &Arc<Self>, row: Option<usize>) -> Slot {
        let rx = {
            let mut s = self.lock();
            let row = row.unwrap_or(usize::MAX).min(s.weights.len() - 1);
            if s.free > 0 && s.waiting.iter().all(VecDeque::is_empty) {
                s.free -= 1;
                s.in_use[row] += 1;
                return Slot {
                    slots: self.clone(),
                    row,
                };
            }
            let (tx, rx) = oneshot::channel();
            let ticket = s.next_ticket;
            s.next_ticket += 1;
            s.waiting[row].push_back((ticket, tx));
            Waiting {
                slots: self.clone(),
                row,
                ticket,
                rx: Some(rx),
            }
        };
        rx.await
    }

    /// A slot of `row` given back: to the most deserving waiter, if any.
    fn release(self: &Arc<Self>, row: usize) {
        let mut s = self.lock();
        s.in_use[row] -= 1;
        s.free += 1;
        Self::grant(self, &mut s);
    }

    /// Hands free slots to waiters, fairest row first: the fewest slots
    /// held for its weight (ties: the lowest row).
    fn grant(this: &Arc<Self>, s: &mut State) {
        while s.free > 0 {
            let best = (0..s.waiting.len())
                .filter(|&r| !s.waiting[r].is_empty())
                .min_by(|&a, &b| {
                    let ka = s.in_use[a] as u64 * u64::from(s.weights[b]);
                    let kb = s.in_use[b] as u64 * u64::from(s.weights[a]);
                    ka.cmp(&kb).then(a.cmp(&b))
                });
            let Some(r) = best else { return };
            let Some((_, tx)) = s.waiting[r].pop_front() else {
                return;
            };
            s.free -= 1;
            s.in_use[r] += 1;
            let slot = Slot {
                slots: this.clone(),
                row: r,
            };
            if let Err(slot) = tx.send(slot) {
                // Its waiter went away meanwhile: the slot is free again
                // (given back here, under the lock, without its drop).
                std::mem::forget(slot);
                s.in_use[r] -= 1;
                s.free += 1;
            }
        }
    }
}

/// A request waiting for a slot: leaves its place when dropped.
struct Waiting {
    slots: Arc<FairSlots>,
    row: usize,
    ticket: u64,
    rx: Option<oneshot::Receiver<Slot>>,
}

impl std::future::Future for Waiting {
    type Output = Slot;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Slot> {
        let Some(rx) = self.rx.as_mut() else {
            return std::task::Poll::Pending;
        };
        match std::pin::Pin::new(rx).poll(cx) {
            std::task::Poll::Ready(Ok(slot)) => {
                self.rx = None;
                std::task::Poll::Ready(slot)
            }
            // The sender is only dropped after a send or with the slots.
            std::task::Poll::Ready(Err(_)) => std::task::Poll::Pending,
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.rx.is_none() {
            return;
        }
        let mut s = self.slots.lock();
        let (row, ticket) = (self.row, self.ticket);
        s.waiting[row].retain(|(t, _)| *t != ticket);
        drop(s);
        // A slot sent but not yet taken is dropped with the receiver: its
        // drop gives it back (to the next waiter).
        if let Some(mut rx) = self.rx.take()
            && let Ok(slot) = rx.try_recv()
        {
            drop(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Two slots, two rows of equal weight: row 0 queues six requests
    /// first, row 1 one after; as slots free, row 1's waiter is served
    /// before row 0's later ones (its share), not after the whole queue.
    #[tokio::test]
    async fn a_contended_slot_goes_to_the_row_holding_fewest_for_its_weight() {
        let slots = FairSlots::new(2);
        slots.set_weights(vec![1, 1]);
        let a = slots.acquire(Some(0)).await;
        let b = slots.acquire(Some(0)).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for (i, row) in [0, 0, 0, 0, 0, 0, 1].into_iter().enumerate() {
            let (slots, order) = (slots.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let slot = slots.acquire(Some(row)).await;
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(slot);
            }));
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop((a, b));
        for w in waiters {
            w.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        let at = order.iter().position(|&i| i == 6).unwrap();
        assert!(at <= 1, "row 1's waiter served {at}th: {order:?}");
        assert_eq!(slots.in_use(), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_leaves_gives_up_its_place_and_any_slot_sent_to_it() {
        let slots = FairSlots::new(1);
        let held = slots.acquire(None).await;
        let gone = tokio::time::timeout(Duration::from_millis(10), slots.acquire(None)).await;
        assert!(gone.is_err());
        drop(held);
        assert_eq!(slots.in_use(), 0, "nothing kept for the waiter that left");
        let again = slots.acquire(None).await;
        assert_eq!(slots.in_use(), 1);
        drop(again);
    }
}

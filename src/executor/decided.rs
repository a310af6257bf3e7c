//! An operation's decision as its task announces it: set once, when the
//! run ends, and read by every caller waiting on the operation (its own
//! caller, replays of its key, `wait_decided`).
//!
//! Tens of thousands of these wait at once, empty, one per operation in
//! flight. A `tokio::sync::watch` channel did the same in 352 bytes (its
//! shared state holds an eight-way notifier for receivers that may see many
//! values); one value needs one `Notify`: 72 bytes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::Notify;

use crate::domain::Operation;

struct Slot {
    value: OnceLock<Box<Operation>>,
    /// The task's end (with or without a decision): set after `value`.
    closed: AtomicBool,
    notify: Notify,
}

/// A new slot: the task's end, and the first of its readers.
pub(crate) fn slot() -> (Announce, Decided) {
    let s = Arc::new(Slot {
        value: OnceLock::new(),
        closed: AtomicBool::new(false),
        notify: Notify::new(),
    });
    (Announce(s.clone()), Decided(s))
}

/// The operation's task's end of the slot. Dropped without `send` (the
/// task stopped, or panicked), it tells every reader there is no decision.
pub(crate) struct Announce(Arc<Slot>);

impl Announce {
    /// The decision, to every reader, present and future.
    pub(crate) fn send(self, op: Operation) {
        if self.0.value.set(Box::new(op)).is_err() {
            // `send` takes the only announcer by value: a second value
            // cannot come. Were it to, the first would stand.
            unreachable!("an operation's decision is announced once");
        }
        // Dropping `self` wakes the readers.
    }

    pub(crate) fn subscribe(&self) -> Decided {
        Decided(self.0.clone())
    }
}

impl Drop for Announce {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }
}

/// A reader of an operation's decision.
#[derive(Clone)]
pub(crate) struct Decided(Arc<Slot>);

impl Decided {
    /// The decision, if it is out.
    pub(crate) fn get(&self) -> Option<Operation> {
        self.0.value.get().map(|op| (**op).clone())
    }

    /// Waits for the decision: `None` when the task ended without one.
    pub(crate) async fn wait(&self) -> Option<Operation> {
        loop {
            // Registered before the checks, so that an end between the
            // checks and the await still wakes this wait
            // (`notify_waiters` wakes only registered waiters).
            let woken = self.0.notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if let Some(op) = self.get() {
                return Some(op);
            }
            if self.0.closed.load(Ordering::Acquire) {
                // The value, if any, was set before `closed`.
                return self.get();
            }
            woken.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn op() -> Operation {
        let mut op = crate::executor::sample_operation();
        op.id = uuid::Uuid::new_v4();
        op
    }

    #[tokio::test]
    async fn every_reader_gets_the_decision_sent_before_or_after_it_waits() {
        let (tx, early) = slot();
        let waiting = tokio::spawn({
            let early = early.clone();
            async move { early.wait().await }
        });
        // Yield until the waiter is parked (it cannot see a value yet).
        tokio::task::yield_now().await;
        let late = tx.subscribe();
        let sent = op();
        tx.send(sent.clone());
        let got = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the waiting reader is woken")
            .expect("the reader's task");
        assert_eq!(got.map(|o| o.id), Some(sent.id));
        assert_eq!(late.wait().await.map(|o| o.id), Some(sent.id));
        assert_eq!(early.get().map(|o| o.id), Some(sent.id));
    }

    #[tokio::test]
    async fn an_end_without_a_decision_wakes_every_reader_with_none() {
        let (tx, rx) = slot();
        let waiting = tokio::spawn({
            let rx = rx.clone();
            async move { rx.wait().await }
        });
        tokio::task::yield_now().await;
        drop(tx);
        let got = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the waiting reader is woken")
            .expect("the reader's task");
        assert!(got.is_none());
        assert!(rx.wait().await.is_none());
        assert!(rx.get().is_none());
    }

    #[test]
    fn a_slot_is_small() {
        // What each operation in flight holds for its decision (the Arc's
        // two counts and the slot): the watch channel it replaced took 352.
        assert!(
            std::mem::size_of::<Slot>() + 16 <= 80,
            "{}",
            std::mem::size_of::<Slot>()
        );
    }
}

//! Shrinking a failing history: drop one step at a time (a happening, a
//! fault, a call with what refers to it) and keep the drop whenever the
//! smaller history still breaks the same invariant. Each try is a real
//! run in a new world, so a try is made twice before it counts as passing
//! (timing can hide a violation once).

use tokio::time::Instant;

use super::history::{Happening, History, KeyChoice};

/// The histories one step smaller than `h`.
pub fn smaller(h: &History) -> Vec<History> {
    let mut out = Vec::new();
    for i in 0..h.happenings.len() {
        let mut s = h.clone();
        s.happenings.remove(i);
        out.push(s);
    }
    for (c, call) in h.calls.iter().enumerate() {
        for f in 0..call.faults.len() {
            let mut s = h.clone();
            s.calls[c].faults.remove(f);
            out.push(s);
        }
        if call.operator.is_some() {
            let mut s = h.clone();
            s.calls[c].operator = None;
            out.push(s);
        }
        if call.cancel_after_ms.is_some() {
            let mut s = h.clone();
            s.calls[c].cancel_after_ms = None;
            out.push(s);
        }
    }
    for c in (0..h.calls.len()).rev() {
        out.push(without_call(h, c));
    }
    out
}

/// `h` without call `c`: later calls that replayed its key get keys of
/// their own, happenings about it go, and later indices move down.
fn without_call(h: &History, c: usize) -> History {
    let mut s = h.clone();
    s.calls.remove(c);
    let shift = |n: usize| if n > c { n - 1 } else { n };
    for call in &mut s.calls {
        call.key = match call.key {
            KeyChoice::Replay(n) | KeyChoice::Foreign(n) if n == c => KeyChoice::Fresh,
            KeyChoice::Replay(n) => KeyChoice::Replay(shift(n)),
            KeyChoice::Foreign(n) => KeyChoice::Foreign(shift(n)),
            KeyChoice::Fresh => KeyChoice::Fresh,
        };
    }
    s.happenings.retain(|t| match t.what {
        Happening::Reconcile(n) | Happening::Resolve(n, _) => n != c,
        _ => true,
    });
    for t in &mut s.happenings {
        match &mut t.what {
            Happening::Reconcile(n) | Happening::Resolve(n, _) => *n = shift(*n),
            _ => {}
        }
    }
    s
}

/// Shrinks `h` while `fails` says a history still breaks the invariant,
/// until no single step can go or `until` comes.
pub async fn shrink<F, Fut>(h: History, until: Instant, mut fails: F) -> History
where
    F: FnMut(History) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut best = h;
    'outer: loop {
        for candidate in smaller(&best) {
            if Instant::now() >= until {
                break 'outer;
            }
            let mut tried = candidate.replayed();
            let mut failed = fails(tried.clone()).await;
            if !failed {
                tried = tried.replayed();
                failed = fails(tried.clone()).await;
            }
            if failed {
                best = tried;
                continue 'outer;
            }
        }
        break;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::chaos::history::Shape;

    #[test]
    fn dropping_a_call_keeps_every_reference_valid() {
        for seed in 0..50 {
            let h = History::generate(seed, &Shape::default());
            for c in 0..h.calls.len() {
                let s = without_call(&h, c);
                assert_eq!(s.calls.len(), h.calls.len() - 1);
                for (i, call) in s.calls.iter().enumerate() {
                    if let KeyChoice::Replay(n) | KeyChoice::Foreign(n) = call.key {
                        assert!(n < i, "seed {seed}: call {i} refers to {n}");
                    }
                }
                for t in &s.happenings {
                    if let Happening::Reconcile(n) | Happening::Resolve(n, _) = t.what {
                        assert!(n < s.calls.len());
                    }
                }
            }
            assert_eq!(smaller(&h).len(), h.size());
        }
    }
}

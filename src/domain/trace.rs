//! W3C Trace Context (`traceparent`, `tracestate`): what a caller's trace
//! header says, checked as the specification asks, and the context an
//! operation carries from then on — the caller's trace id, this service's
//! own span id (the parent of every request it sends for the operation),
//! and the caller's `tracestate`, passed on unchanged.
//!
//! A header that does not parse is ignored, never an error to the caller
//! (the specification's rule); the operation then starts a trace of its
//! own, as it does without a header, so Nova's logs can still be joined
//! with this service's by one trace id.

use std::fmt;

/// The longest `tracestate` passed on (the specification's limit: a
/// vendor may drop a longer one whole).
const MAX_STATE_LEN: usize = 512;
/// The most list members a `tracestate` may have.
const MAX_STATE_MEMBERS: usize = 32;
/// The `sampled` flag, the only one defined (level 1); others are zeroed.
const SAMPLED: u8 = 0x01;

/// Why a caller's trace header was ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{header} ignored: {reason}")]
pub struct InvalidTrace {
    pub header: &'static str,
    pub reason: String,
}

fn invalid(header: &'static str, reason: impl Into<String>) -> InvalidTrace {
    InvalidTrace {
        header,
        reason: reason.into(),
    }
}

/// The trace an operation belongs to, and its place in it.
#[derive(Clone, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: [u8; 16],
    /// This service's span for the operation (or for a later pass over
    /// it): the parent id of every request sent under this context.
    span_id: [u8; 8],
    /// The span this one descends from: the caller's, or the operation's
    /// first span for a later pass; `None` when this service began the
    /// trace.
    parent_id: Option<[u8; 8]>,
    sampled: bool,
    /// The caller's `tracestate`, unchanged.
    state: Option<String>,
}

impl fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.traceparent())
    }
}

fn random_nonzero<const N: usize>() -> [u8; N] {
    loop {
        let bytes: [u8; N] = rand::random();
        if bytes.iter().any(|b| *b != 0) {
            return bytes;
        }
    }
}

/// Lowercase hex, two digits a byte. By table, not `format!` per byte:
/// every Nova request and every intent formats a traceparent, and the
/// formatter's per-byte allocation was 3.6 % of the service's CPU at c=64.
fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(2 * bytes.len());
    push_hex(&mut out, bytes);
    out
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// `N` bytes from exactly `2N` lowercase hex digits.
fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let digits = s.as_bytes();
    if digits.len() != 2 * N
        || !digits
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in digits.chunks(2).enumerate() {
        // Two checked hex digits always parse.
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// `(trace id, parent id, flags)` of a `traceparent` value.
fn parse_traceparent(value: &str) -> Result<([u8; 16], [u8; 8], u8), InvalidTrace> {
    const H: &str = "traceparent";
    let bad = |why: &str| invalid(H, format!("{why} in {value:?}"));
    let value = value.trim_matches([' ', '\t']);
    let version = value.get(..2).ok_or_else(|| bad("too short"))?;
    let version =
        unhex::<1>(version).ok_or_else(|| bad("version is not 2 lowercase hex digits"))?;
    match version[0] {
        0xff => return Err(bad("version ff is forbidden")),
        // Version 00 is exactly 55 characters; a later version may append
        // fields after a dash, and is read as far as 00 goes.
        0x00 if value.len() != 55 => return Err(bad("version 00 must be 55 characters")),
        _ if value.len() < 55 || (value.len() > 55 && value.as_bytes()[55] != b'-') => {
            return Err(bad("not version-traceid-parentid-flags"));
        }
        _ => {}
    }
    let head = value.get(..55).ok_or_else(|| bad("not ASCII"))?;
    let fields: Vec<&str> = head.split('-').collect();
    let [_, trace, parent, flags] = fields[..] else {
        return Err(bad("not version-traceid-parentid-flags"));
    };
    let trace = unhex::<16>(trace).ok_or_else(|| bad("trace-id is not 32 lowercase hex digits"))?;
    let parent =
        unhex::<8>(parent).ok_or_else(|| bad("parent-id is not 16 lowercase hex digits"))?;
    let flags =
        unhex::<1>(flags).ok_or_else(|| bad("trace-flags is not 2 lowercase hex digits"))?;
    if trace == [0; 16] {
        return Err(bad("trace-id is all zeros"));
    }
    if parent == [0; 8] {
        return Err(bad("parent-id is all zeros"));
    }
    Ok((trace, parent, flags[0]))
}

/// A `tracestate` kept only when it is well formed: printable ASCII, at
/// most 512 characters and 32 `key=value` members.
fn check_state(value: &str) -> Result<String, InvalidTrace> {
    const H: &str = "tracestate";
    let value = value.trim_matches([' ', '\t']);
    if value.len() > MAX_STATE_LEN {
        return Err(invalid(
            H,
            format!("{} characters; at most {MAX_STATE_LEN}", value.len()),
        ));
    }
    if let Some(c) = value.chars().find(|c| !(' '..='~').contains(c)) {
        return Err(invalid(H, format!("contains {c:?}")));
    }
    let members: Vec<&str> = value
        .split(',')
        .map(|m| m.trim_matches([' ', '\t']))
        .filter(|m| !m.is_empty())
        .collect();
    if members.len() > MAX_STATE_MEMBERS {
        return Err(invalid(
            H,
            format!("{} members; at most {MAX_STATE_MEMBERS}", members.len()),
        ));
    }
    if let Some(m) = members.iter().find(|m| {
        m.split_once('=')
            .is_none_or(|(k, v)| k.is_empty() || v.is_empty())
    }) {
        return Err(invalid(H, format!("member {m:?} is not key=value")));
    }
    Ok(members.join(","))
}

impl TraceContext {
    /// A trace this service begins (no usable header from the caller).
    pub fn start() -> Self {
        Self {
            trace_id: random_nonzero(),
            span_id: random_nonzero(),
            parent_id: None,
            sampled: true,
            state: None,
        }
    }

    /// The caller's trace, continued under a span of this service's own.
    /// `traceparent` is every value the caller sent (more than one is
    /// invalid); `tracestate` its values in order (joined as one list).
    /// What does not parse is ignored: the trace then starts here, and the
    /// reason is returned for a debug log.
    pub fn accept(traceparent: &[&str], tracestate: &[&str]) -> (Self, Option<InvalidTrace>) {
        let parsed = match traceparent {
            [] => return (Self::start(), None),
            [one] => parse_traceparent(one),
            _ => Err(invalid(
                "traceparent",
                format!("sent {} times", traceparent.len()),
            )),
        };
        let (trace_id, parent, flags) = match parsed {
            Ok(p) => p,
            Err(e) => return (Self::start(), Some(e)),
        };
        let (state, problem) = match tracestate {
            [] => (None, None),
            values => match check_state(&values.join(",")) {
                Ok(s) if s.is_empty() => (None, None),
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e)),
            },
        };
        let ctx = Self {
            trace_id,
            span_id: random_nonzero(),
            parent_id: Some(parent),
            sampled: flags & SAMPLED != 0,
            state,
        };
        (ctx, problem)
    }

    /// The context as the ledger keeps it (`traceparent` and
    /// `tracestate` of this service's span), read back; `None` if it does
    /// not parse (a row written by hand, or by a later version).
    pub fn from_stored(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let (trace_id, span_id, flags) = parse_traceparent(traceparent).ok()?;
        Some(Self {
            trace_id,
            span_id,
            parent_id: None,
            sampled: flags & SAMPLED != 0,
            state: tracestate
                .filter(|s| !s.is_empty())
                .and_then(|s| check_state(s).ok()),
        })
    }

    /// A new span of this service in the same trace, below this one (a
    /// later pass over the operation: the reconciler's).
    pub fn child(&self) -> Self {
        Self {
            span_id: random_nonzero(),
            parent_id: Some(self.span_id),
            state: self.state.clone(),
            ..*self
        }
    }

    /// The `traceparent` sent with every request under this context: the
    /// trace id, and this service's span as the parent.
    /// Written digit by digit: it is made four times a call (the intent,
    /// its log, the request to Nova), where `format!` cost ten times more.
    pub fn traceparent(&self) -> String {
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        push_hex(&mut out, &self.trace_id);
        out.push('-');
        push_hex(&mut out, &self.span_id);
        out.push('-');
        push_hex(&mut out, &[if self.sampled { SAMPLED } else { 0 }]);
        out
    }

    pub fn tracestate(&self) -> Option<&str> {
        self.state.as_deref()
    }

    /// 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        hex(&self.trace_id)
    }

    /// 16 lowercase hex digits: this service's span.
    pub fn span_id(&self) -> String {
        hex(&self.span_id)
    }

    /// The span this one descends from, if any.
    pub fn parent_span_id(&self) -> Option<String> {
        self.parent_id.map(|p| hex(&p))
    }

    pub fn trace_id_bytes(&self) -> [u8; 16] {
        self.trace_id
    }

    pub fn span_id_bytes(&self) -> [u8; 8] {
        self.span_id
    }

    pub fn parent_id_bytes(&self) -> Option<[u8; 8]> {
        self.parent_id
    }

    pub fn sampled(&self) -> bool {
        self.sampled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_continued_under_a_span_of_our_own() {
        let (ctx, problem) = TraceContext::accept(&[GOOD], &["congo=t61rcWkgMzE", "rojo=00f0"]);
        assert_eq!(problem, None);
        assert_eq!(ctx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(ctx.parent_span_id().as_deref(), Some("00f067aa0ba902b7"));
        assert_ne!(ctx.span_id(), "00f067aa0ba902b7");
        assert!(ctx.sampled());
        assert_eq!(ctx.tracestate(), Some("congo=t61rcWkgMzE,rojo=00f0"));
        let sent = ctx.traceparent();
        assert!(
            sent.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && sent.ends_with("-01"),
            "{sent}"
        );
        assert_eq!(sent.len(), 55);
        assert_eq!(
            sent,
            format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01", ctx.span_id())
        );
        // What the ledger keeps reads back as the same span.
        let back = TraceContext::from_stored(&sent, ctx.tracestate()).unwrap();
        assert_eq!(back.traceparent(), sent);
        let later = back.child();
        assert_eq!(later.trace_id(), ctx.trace_id());
        assert_eq!(later.parent_span_id(), Some(ctx.span_id()));
        assert_ne!(later.span_id(), ctx.span_id());
    }

    #[test]
    fn unsampled_traces_stay_unsampled_and_unknown_flags_are_zeroed() {
        let (ctx, _) = TraceContext::accept(
            &["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"],
            &[],
        );
        assert!(ctx.traceparent().ends_with("-00"));
        let (ctx, _) = TraceContext::accept(
            &["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09"],
            &[],
        );
        assert!(ctx.traceparent().ends_with("-01"));
    }

    #[test]
    fn later_versions_are_read_as_far_as_version_00_goes() {
        let (ctx, problem) =
            TraceContext::accept(&[&format!("cc{}-what-comes-next", &GOOD[2..])], &[]);
        assert_eq!(problem, None);
        assert_eq!(ctx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(ctx.traceparent().starts_with("00-"));
    }

    #[test]
    fn malformed_traceparents_start_a_trace_of_our_own() {
        for bad in [
            "",
            "00",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            let (ctx, problem) = TraceContext::accept(&[bad], &["k=v"]);
            assert!(problem.is_some(), "{bad:?} was accepted");
            assert_ne!(
                ctx.trace_id(),
                "4bf92f3577b34da6a3ce929d0e0e4736",
                "{bad:?}"
            );
            assert_eq!(ctx.parent_span_id(), None, "{bad:?}");
            assert_eq!(
                ctx.tracestate(),
                None,
                "no tracestate without a traceparent"
            );
        }
        let (_, problem) = TraceContext::accept(&[GOOD, GOOD], &[]);
        assert!(problem.unwrap().reason.contains("2 times"));
    }

    #[test]
    fn a_malformed_tracestate_is_dropped_and_the_traceparent_kept() {
        for bad in [
            "novalue",
            "k=v,=x",
            &"k=v,".repeat(33),
            &format!("k={}", "v".repeat(600)),
            "k=v\u{7f}",
        ] {
            let (ctx, problem) = TraceContext::accept(&[GOOD], &[bad]);
            assert!(problem.is_some(), "{bad:?}");
            assert_eq!(ctx.tracestate(), None);
            assert_eq!(ctx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        }
    }

    #[test]
    fn a_trace_we_start_is_random_sampled_and_has_no_parent() {
        let (a, problem) = TraceContext::accept(&[], &[]);
        assert_eq!(problem, None);
        let b = TraceContext::start();
        assert_ne!(a.trace_id(), b.trace_id());
        assert_eq!(a.parent_span_id(), None);
        assert!(a.traceparent().ends_with("-01"));
        assert!(TraceContext::from_stored(&a.traceparent(), None).is_some());
        assert!(TraceContext::from_stored("nonsense", None).is_none());
    }
}

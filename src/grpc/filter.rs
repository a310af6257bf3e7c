//! A list's or a bulk call's filter, parsed at the edge into the store's
//! `OperationFilter` (one place for every filter: `ListOperations`, and
//! `ReconcileOperations`/`ResolveOperations`), and a list's page.

use tonic::Status;

use super::request::Scope;
use super::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, convert, optional, pb, status};
use crate::domain::validate::parse_uuid;
use crate::domain::{Caller, InvalidField, Labels};
use crate::store::{ListCursor, OperationFilter, TimeRange};

/// The names of a filter's fields as a request spells them: at the top
/// of `ListOperationsRequest` (the filters it had first), or in an
/// `OperationFilter` message.
struct Names {
    state: &'static str,
    server_id: &'static str,
    volume_id: &'static str,
    caller: &'static str,
    labels: &'static str,
    created: &'static str,
    updated: &'static str,
}

const TOP: Names = Names {
    state: "state",
    server_id: "server_id",
    volume_id: "volume_id",
    caller: "caller",
    labels: "labels",
    created: "created_before",
    updated: "updated_before",
};

const NESTED: Names = Names {
    state: "filter.state",
    server_id: "filter.server_id",
    volume_id: "filter.volume_id",
    caller: "filter.caller",
    labels: "filter.labels",
    created: "filter.created_before",
    updated: "filter.updated_before",
};

/// `ListOperations`' filter: the fields at its top, or its `filter`
/// message (not both).
pub(super) fn of_list(
    r: &pb::ListOperationsRequest,
    scope: &Scope,
) -> Result<OperationFilter, Status> {
    let top = pb::OperationFilter {
        state: r.state,
        server_id: r.server_id.clone(),
        volume_id: r.volume_id.clone(),
        drifted_only: r.drifted_only,
        escalated_only: r.escalated_only,
        caller: r.caller.clone(),
        ..Default::default()
    };
    match &r.filter {
        None => parse(&top, scope, &TOP),
        Some(f) if top == pb::OperationFilter::default() => parse(f, scope, &NESTED),
        Some(_) => Err(status::invalid(InvalidField::new(
            "filter",
            "give the filters either at the top of the request or in filter, not both",
        ))),
    }
}

/// A bulk call's filter (absent: every operation the caller reads).
pub(super) fn of_bulk(
    f: Option<&pb::OperationFilter>,
    scope: &Scope,
) -> Result<OperationFilter, Status> {
    parse(f.unwrap_or(&pb::OperationFilter::default()), scope, &NESTED)
}

/// Why it is long: each field is read with its own error for the caller.
fn parse(f: &pb::OperationFilter, scope: &Scope, n: &Names) -> Result<OperationFilter, Status> {
    let named = convert::caller_filter(n.caller, &f.caller).map_err(status::invalid)?;
    // An orchestrator's list is its own, filtered in the store's query (a
    // page is full, and holds nothing of anyone else's); `caller` is an
    // operator's filter.
    let caller = match (scope, named) {
        (Scope::All, named) => named,
        (Scope::Own(own), None) => Some(own.clone()),
        (Scope::Own(own), Some(c)) if c == *own => Some(c),
        (Scope::Own(_), Some(_)) => {
            return Err(status::invalid(InvalidField::new(
                n.caller,
                "only an operator may list another caller's operations (an orchestrator's list is always its own)",
            )));
        }
    };
    let state = match pb::State::try_from(f.state) {
        Ok(s) => convert::state_from_pb(s),
        Err(_) => {
            return Err(status::invalid(InvalidField::new(
                n.state,
                format!("unknown state value {}", f.state),
            )));
        }
    };
    Ok(OperationFilter {
        state,
        server_id: optional(&f.server_id, |v| parse_uuid(n.server_id, v))?,
        volume_id: optional(&f.volume_id, |v| parse_uuid(n.volume_id, v))?,
        drifted_only: f.drifted_only,
        escalated_only: f.escalated_only,
        caller: caller.map(Caller::named),
        labels: Labels::parse(n.labels, f.labels.clone()).map_err(status::invalid)?,
        created: range(
            n.created,
            f.created_after.as_ref(),
            f.created_before.as_ref(),
        )?,
        updated: range(
            n.updated,
            f.updated_after.as_ref(),
            f.updated_before.as_ref(),
        )?,
        open_only: false,
        id: None,
    })
}

/// A time range; `field` (its end's name) when it ends before it begins.
fn range(
    field: &'static str,
    from: Option<&prost_types::Timestamp>,
    before: Option<&prost_types::Timestamp>,
) -> Result<TimeRange, Status> {
    let at = |t: Option<&prost_types::Timestamp>| {
        t.map(|t| convert::timestamp_from_pb(field, t))
            .transpose()
            .map_err(status::invalid)
    };
    let r = TimeRange {
        from: at(from)?,
        before: at(before)?,
    };
    if let (Some(a), Some(b)) = (r.from, r.before)
        && b <= a
    {
        return Err(status::invalid(InvalidField::new(
            field,
            format!("{b} is not after the range's start {a}"),
        )));
    }
    Ok(r)
}

/// A list's page size and where it starts.
pub(super) fn page(page_size: i32, page_token: &str) -> Result<(u32, Option<ListCursor>), Status> {
    let limit = match page_size {
        0 => DEFAULT_PAGE_SIZE,
        n if n < 0 => {
            return Err(status::invalid(InvalidField::new(
                "page_size",
                "must not be negative",
            )));
        }
        n if n as u32 > MAX_PAGE_SIZE => {
            return Err(status::invalid(InvalidField::new(
                "page_size",
                format!("{n} exceeds the maximum page size of {MAX_PAGE_SIZE}"),
            )));
        }
        n => n as u32,
    };
    if page_token.is_empty() {
        return Ok((limit, None));
    }
    let after = convert::decode_page_token(page_token).ok_or_else(|| {
        status::invalid(InvalidField::new(
            "page_token",
            "is not a token this server issued",
        ))
    })?;
    Ok((limit, Some(after)))
}

//! README's "How an outcome is decided" is the specification of this
//! module: these tests read its two tables and check every row, and that
//! every answer the tests know has a row.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::nova::Stage;

const SERVER: Uuid = Uuid::from_u128(0x7ebe_d2ce_85b3_40b5_84ae_8cc7_25c3_7ed2);
const OTHER: &str = "3a9b7c1e-0000-4000-8000-000000000001";

fn err(kind: NovaErrorKind, stage: Stage, status: Option<u16>, reached: bool) -> NovaError {
    NovaError {
        kind,
        stage,
        method: "POST",
        url: "http://nova/v2.1/servers/x/os-volume_attachments".into(),
        status,
        nova_request_id: None,
        nova_fault: None,
        nova_message: None,
        elapsed: Duration::from_millis(5),
        budget: Duration::from_secs(1),
        may_have_reached_nova: reached,
        cause: "sample".into(),
    }
}

fn rejected(r: Rejection, status: u16) -> NovaError {
    err(
        NovaErrorKind::Rejected(r),
        Stage::AwaitHeaders,
        Some(status),
        true,
    )
}

/// A sample of each answer README's table names, by its cell text.
fn samples() -> BTreeMap<&'static str, Option<NovaError>> {
    sample_map(rejection_samples(), failure_samples())
}

/// Nova's rejections: (cell, rejection, HTTP status).
fn rejection_samples() -> [(&'static str, Rejection, u16); 16] {
    let already = |server: String| Rejection::AlreadyAttached {
        servers: vec![server],
    };
    [
        (
            "400 already attached to another server",
            already(OTHER.into()),
            400,
        ),
        (
            "400 already attached, to no other server",
            already(SERVER.to_string()),
            400,
        ),
        (
            "400 not in use (detaching or attaching)",
            Rejection::Detaching,
            400,
        ),
        ("404 not attached", Rejection::NotAttached, 404),
        ("404 server not found", Rejection::ServerNotFound, 404),
        ("404 volume not found", Rejection::VolumeNotFound, 404),
        ("403 forbidden", Rejection::Forbidden, 403),
        ("400 other", Rejection::BadRequest, 400),
        ("401 after re-authenticating", Rejection::Unauthorized, 401),
        ("409 locked or task_state", Rejection::Conflict, 409),
        ("413/429 over limit", Rejection::Throttled, 429),
        ("409 device path in use", Rejection::DeviceInUse, 409),
        (
            "400 volume not ready",
            Rejection::VolumeNotReady {
                status: "creating".into(),
            },
            400,
        ),
        (
            "400 volume in an error status",
            Rejection::VolumeNotReady {
                status: "error_attaching".into(),
            },
            400,
        ),
        ("5xx", Rejection::ServerError, 500),
        ("other status", Rejection::Other, 418),
    ]
}

/// Failures before, during or after the exchange: (cell, kind, stage, HTTP
/// status, may have reached Nova).
fn failure_samples() -> [FailureSample; 8] {
    use NovaErrorKind::*;
    [
        (
            "connect failure",
            ConnectFailed,
            Stage::Connect,
            None,
            false,
        ),
        (
            "Keystone failure",
            AuthFailed,
            Stage::Authenticate,
            None,
            false,
        ),
        (
            "deadline before sending",
            DeadlineExceeded,
            Stage::AcquireSlot,
            None,
            false,
        ),
        (
            "deadline awaiting headers",
            DeadlineExceeded,
            Stage::AwaitHeaders,
            None,
            true,
        ),
        (
            "deadline reading the body",
            DeadlineExceeded,
            Stage::ReadBody,
            Some(200),
            true,
        ),
        (
            "connection reset",
            ResponseLost,
            Stage::AwaitHeaders,
            None,
            true,
        ),
        (
            "truncated body",
            ResponseLost,
            Stage::ReadBody,
            Some(200),
            true,
        ),
        (
            "2xx that does not decode",
            Undecodable,
            Stage::Decode,
            Some(200),
            true,
        ),
    ]
}

type FailureSample = (&'static str, NovaErrorKind, Stage, Option<u16>, bool);

fn sample_map(
    rejections: [(&'static str, Rejection, u16); 16],
    failures: [FailureSample; 8],
) -> BTreeMap<&'static str, Option<NovaError>> {
    let mut m: BTreeMap<&'static str, Option<NovaError>> =
        [("200", None), ("202", None)].into_iter().collect();
    for (cell, r, status) in rejections {
        m.insert(cell, Some(rejected(r, status)));
    }
    for (cell, kind, stage, status, reached) in failures {
        m.insert(cell, Some(err(kind, stage, status, reached)));
    }
    m
}

/// The rows of the first table after `heading` in README.md, as cells
/// with their backticks removed.
fn readme_table(heading_marker: &str) -> Vec<Vec<String>> {
    let readme = include_str!("../../../README.md");
    let start = readme
        .find(heading_marker)
        .unwrap_or_else(|| panic!("README.md has no {heading_marker:?}"));
    let rows: Vec<Vec<String>> = readme[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2) // header and separator
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().trim_matches('`').to_string())
                .collect()
        })
        .collect();
    assert!(
        !rows.is_empty(),
        "the table after {heading_marker:?} is empty"
    );
    rows
}

fn actions(cell: &str) -> Vec<Action> {
    match cell {
        "attach" => vec![Action::Attach],
        "detach" => vec![Action::Detach],
        "any" => vec![Action::Attach, Action::Detach],
        other => panic!("README row with action {other:?} (attach, detach or any)"),
    }
}

#[test]
fn every_answer_in_the_readme_table_is_classified_as_the_row_says() {
    let samples = samples();
    let rows = readme_table("<!-- classify: answers -->");
    let mut covered = std::collections::BTreeSet::new();
    for row in &rows {
        let [action, answer, next] = &row[..] else {
            panic!("README row {row:?} does not have 3 cells");
        };
        let sample = samples.get(answer.as_str()).unwrap_or_else(|| {
            panic!("README names an answer the test has no sample of: {answer:?}")
        });
        covered.insert(answer.as_str());
        for a in actions(action) {
            let ans = match (answer.as_str(), sample) {
                ("200", _) => Answer::Done,
                ("202", _) => Answer::Accepted,
                (_, Some(e)) => Answer::Failed(e),
                (_, None) => unreachable!(),
            };
            let got = classify(a, SERVER, &ans).to_string();
            assert_eq!(
                &got,
                next,
                "README row ({action} | {answer}) for {}",
                a.as_str()
            );
        }
    }
    let missing: Vec<_> = samples.keys().filter(|k| !covered.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "answers without a README row: {missing:?}"
    );
}

#[test]
fn refusals_and_running_out_of_time_expand_as_the_readme_says() {
    let rows = readme_table("<!-- classify: expansions -->");
    for row in &rows {
        let [action, step, earlier, next] = &row[..] else {
            panic!("README row {row:?} does not have 4 cells");
        };
        let history = match earlier.as_str() {
            "no" => History::default(),
            "yes" => History {
                earlier: true,
                this: true,
            },
            other => panic!("README row says {other:?} (yes or no)"),
        };
        for a in actions(action) {
            let got = match step.split_once(' ') {
                Some(("refuse", reason)) => {
                    let reason = Reason::parse(reason)
                        .unwrap_or_else(|| panic!("README names an unknown reason {reason:?}"));
                    refuse(a, history, reason)
                }
                _ if step == "out of time" => out_of_time(a, history),
                _ if step == "retry" => no_resend(a, history).unwrap_or(Next::Retry {
                    why: "",
                    otherwise: Box::new(Next::OutOfTime),
                }),
                _ => panic!("README row with step {step:?}"),
            };
            assert_eq!(
                &got.to_string(),
                next,
                "README row ({action} | {step} | {earlier}) for {}",
                a.as_str()
            );
        }
    }
}

//! docs/design.md's "How an outcome is decided" is the specification of
//! this module: these tests read its two tables and check every row, and
//! that every answer the tests know has a row.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::executor::Seen;
use crate::nova::Stage;
use crate::nova::answer::{AttachShape, Judged, gone_if_shown_gone, judged, read_answer};

const SERVER: Uuid = Uuid::from_u128(0x7ebe_d2ce_85b3_40b5_84ae_8cc7_25c3_7ed2);
const OTHER: &str = "3a9b7c1e-0000-4000-8000-000000000001";

fn err(kind: NovaErrorKind, stage: Stage, status: Option<u16>, reached: bool) -> NovaError {
    NovaError {
        kind,
        stage,
        method: "POST",
        url: "http://nova/v2.1/servers/x/os-volume_attachments".into(),
        status,
        request_id: None,
        fault: None,
        message: None,
        elapsed: Duration::from_millis(5),
        budget: Duration::from_secs(1),
        may_have_reached: reached,
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

/// The samples of each answer docs/design.md's table names, by its cell
/// text: none for a success (`200`, `202`), else the errors that answer is.
fn samples() -> BTreeMap<&'static str, Option<Vec<NovaError>>> {
    let mut m = sample_map(rejection_samples(), failure_samples());
    for (cell, errors) in wire_samples() {
        assert!(
            m.insert(cell, Some(errors)).is_none(),
            "{cell:?} sampled twice"
        );
    }
    m
}

const NGINX_404: &str = "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
const JSON: &str = "application/json; charset=UTF-8";

/// Answers as they come over the wire, judged by the adapter itself
/// (`nova::answer`): what docs/design.md calls Nova's own answers and what
/// it says is not. (cell, [(call, status, content type, body)]). Long on
/// purpose: a table of samples, one per cell of the design doc's table,
/// read against it row by row.
fn wire_samples() -> Vec<(&'static str, Vec<NovaError>)> {
    let server_gone = format!(
        r#"{{"itemNotFound": {{"code": 404, "message": "Instance {SERVER} could not be found."}}}}"#
    );
    let attachment = format!(
        r#"{{"volumeAttachment": {{"device": "/dev/vdb", "id": "{OTHER}", "serverId": "{SERVER}", "volumeId": "{OTHER}"}}}}"#
    );
    let foreign: Vec<(u16, &str, String)> = vec![
        // An ingress that lost its route; ingress-nginx's default backend.
        (404, "text/html", NGINX_404.into()),
        (404, "text/plain", "default backend - 404".into()),
        // An API gateway's own JSON.
        (404, "application/json", r#"{"message":"no Route matched with those values"}"#.into()),
        // nginx and haproxy in front of a nova-api that is down or slow.
        (502, "text/html", "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center></body></html>".into()),
        (503, "text/html", "<html><body><h1>503 Service Unavailable</h1>\nNo server is available to handle this request.\n</body></html>".into()),
        (504, "text/html", "Gateway Timeout".into()),
        // A proxy's own authentication, not keystonemiddleware's.
        (401, "text/html", "<html><head><title>401 Authorization Required</title></head></html>".into()),
        (401, "application/json", r#"{"message":"Unauthorized"}"#.into()),
        // Nova's fault, cut short by a proxy that buffered it.
        (404, JSON, server_gone[..server_gone.len() - 4].to_string()),
        (409, JSON, r#"{"conflictingRequest": {"code": 409, "mess"#.into()),
        // A fault whose name is not the status's.
        (404, JSON, server_gone.replace("itemNotFound", "computeFault")),
    ];
    let refusals = |list: &[(u16, &str, String)]| -> Vec<NovaError> {
        list.iter()
            .flat_map(|(status, ct, body)| {
                [Judged::Attach(AttachShape::Attached), Judged::Detach]
                    .map(|call| judged(call, *status, ct, body, SERVER, OTHER_ID))
            })
            .collect()
    };
    let attach = |shape, status, ct: &str, body: &str| {
        judged(Judged::Attach(shape), status, ct, body, SERVER, OTHER_ID)
    };
    let detach =
        |status, ct: &str, body: &str| judged(Judged::Detach, status, ct, body, SERVER, OTHER_ID);
    let mut samples = vec![
        (
            "404 server not found",
            refusals(&[(404, JSON, server_gone.clone())]),
        ),
        (
            "404 server not found, naming another server",
            refusals(&[(404, JSON, server_gone.replace(&SERVER.to_string(), OTHER))]),
        ),
        (
            "404 about no server, volume or attachment",
            refusals(&[(
                404,
                JSON,
                r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#
                    .into(),
            )]),
        ),
        (
            "error status whose body is not Nova's fault",
            refusals(&foreign),
        ),
        (
            "200 whose body is not Nova's attachment",
            vec![
                attach(
                    AttachShape::Attached,
                    200,
                    "text/html",
                    "<html><body>Please sign in to the hotel network</body></html>",
                ),
                attach(
                    AttachShape::Attached,
                    200,
                    JSON,
                    r#"{"volumeAttachment": {"volumeId""#,
                ),
                attach(
                    AttachShape::Attached,
                    200,
                    JSON,
                    &attachment.replace(OTHER, "5aa119a8-d25b-45a7-8d1b-88e127885635"),
                ),
            ],
        ),
        (
            "success Nova does not give at the microversion",
            vec![
                attach(AttachShape::Accepted, 200, JSON, &attachment),
                attach(AttachShape::Attached, 202, JSON, ""),
                attach(
                    AttachShape::Accepted,
                    202,
                    "text/html",
                    "<html>Accepted</html>",
                ),
                attach(AttachShape::Either, 204, JSON, ""),
            ],
        ),
        (
            "success other than an empty 202",
            vec![
                detach(200, "text/html", "<html><body>OK</body></html>"),
                detach(204, "text/plain", ""),
                detach(202, "text/html", "<html>queued</html>"),
            ],
        ),
    ];
    samples.extend(message_samples());
    samples
}

// Nova's messages, as its nova-api words them (and translated).
const GERMAN_NOT_READY: &str = "Ungültige Eingabe empfangen: Ungültiger Datenträger: Der Datenträger muss verfügbar sein, aber sein Status ist creating.";
const UNKNOWN_400: &str = "Some refusal no one wrote down here.";
const MULTIATTACH_BEFORE_2_60: &str =
    "Multiattach volumes are only supported starting with compute API version 2.60.";
const SCHEMA: &str = "Invalid input for field/attribute volumeAttachment. Value: {'volumeId': 'x'}. 'x' is not a 'uuid'";
const DEVICE_PATH: &str = "The supplied device path (/dev/hdz) is invalid.";
const POLICY: &str =
    "Policy doesn't allow os_compute_api:os-volumes-attachments:create to be performed.";
const TOO_MANY_DISKS: &str = "The maximum allowed number of disk devices (26) to attach to a single instance has been exceeded.";
const GERMAN_TOO_MANY_DISKS: &str =
    "Die maximal zulässige Anzahl von Plattengeräten (26) wurde überschritten.";

/// Nova's faults whose messages name what they are about, or whose words
/// the service reads (or does not): as they come over the wire, judged by
/// the adapter. `SERVER` and `OTHER_ID` are the request's server and
/// volume.
fn message_samples() -> Vec<(&'static str, Vec<NovaError>)> {
    let fault = |status: u16, message: &str| {
        let name = crate::nova::error::fault::fault_name(status);
        let body = serde_json::json!({ name: {"code": status, "message": message} });
        (status, body.to_string())
    };
    let on = |calls: &[Judged], faults: Vec<(u16, String)>| -> Vec<NovaError> {
        faults
            .iter()
            .flat_map(|(status, body)| {
                calls
                    .iter()
                    .map(|call| judged(*call, *status, JSON, body, SERVER, OTHER_ID))
            })
            .collect()
    };
    let both = [Judged::Attach(AttachShape::Attached), Judged::Detach];
    let attach = [Judged::Attach(AttachShape::Attached)];
    let (volume, another) = (OTHER_ID, "5aa119a8-d25b-45a7-8d1b-88e127885635");
    let not_attached = |s: &dyn std::fmt::Display, v: &dyn std::fmt::Display| {
        fault(404, &format!("Instance {s} is not attached to volume {v}"))
    };
    let volume_not_found =
        |v: &dyn std::fmt::Display| fault(404, &format!("Volume {v} could not be found."));
    // The simulator's pseudo-locale (every word but ids spelled backwards).
    let pseudo_not_ready =
        format!("dilavnI tupni :deviecer dilavnI :emulov emuloV {volume} sutats tsum eb elbaliava");
    let elsewhere =
        format!("Invalid volume: volume {another} is already attached to instances: {SERVER}");
    vec![
        (
            "404 volume not found",
            on(&both, vec![volume_not_found(&volume)]),
        ),
        (
            "404 volume not found, naming another volume",
            on(&both, vec![volume_not_found(&another)]),
        ),
        (
            "404 not attached",
            on(&[Judged::Detach], vec![not_attached(&SERVER, &volume)]),
        ),
        (
            "404 not attached, answering an attach",
            on(&attach, vec![not_attached(&SERVER, &volume)]),
        ),
        (
            "404 not attached, naming another server or volume",
            on(
                &both,
                vec![
                    not_attached(&OTHER, &volume),
                    not_attached(&SERVER, &another),
                    not_attached(&volume, &SERVER),
                ],
            ),
        ),
        (
            "400 already attached, naming another volume",
            on(&attach, vec![fault(400, &elsewhere)]),
        ),
        (
            "400 read as final",
            on(
                &both,
                vec![
                    fault(400, MULTIATTACH_BEFORE_2_60),
                    fault(400, SCHEMA),
                    fault(400, DEVICE_PATH),
                ],
            ),
        ),
        (
            "400 not read",
            on(
                &both,
                vec![
                    fault(400, GERMAN_NOT_READY),
                    fault(400, &pseudo_not_ready),
                    fault(400, UNKNOWN_400),
                ],
            ),
        ),
        ("403 policy", on(&both, vec![fault(403, POLICY)])),
        (
            "403 too many disks",
            on(&both, vec![fault(403, TOO_MANY_DISKS)]),
        ),
        (
            "403 not read",
            on(&both, vec![fault(403, GERMAN_TOO_MANY_DISKS)]),
        ),
    ]
}

const OTHER_ID: Uuid = Uuid::from_u128(0x3a9b_7c1e_0000_4000_8000_0000_0000_0001);

/// Nova's rejections: (cell, rejection, HTTP status).
fn rejection_samples() -> [(&'static str, Rejection, u16); 11] {
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
fn failure_samples() -> [FailureSample; 9] {
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
        (
            "body over the size cap",
            TooLarge,
            Stage::ReadBody,
            Some(200),
            true,
        ),
    ]
}

type FailureSample = (&'static str, NovaErrorKind, Stage, Option<u16>, bool);

fn sample_map(
    rejections: [(&'static str, Rejection, u16); 11],
    failures: [FailureSample; 9],
) -> BTreeMap<&'static str, Option<Vec<NovaError>>> {
    let mut m: BTreeMap<&'static str, Option<Vec<NovaError>>> =
        [("200", None), ("202", None)].into_iter().collect();
    for (cell, r, status) in rejections {
        m.insert(cell, Some(vec![rejected(r, status)]));
    }
    for (cell, kind, stage, status, reached) in failures {
        m.insert(cell, Some(vec![err(kind, stage, status, reached)]));
    }
    m
}

/// The rows of the first table after `heading` in docs/design.md, as cells
/// with their backticks removed.
fn design_table(heading_marker: &str) -> Vec<Vec<String>> {
    let doc = include_str!("../../../docs/design.md");
    let start = doc
        .find(heading_marker)
        .unwrap_or_else(|| panic!("docs/design.md has no {heading_marker:?}"));
    let rows: Vec<Vec<String>> = doc[start..]
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
        other => panic!("docs/design.md row with action {other:?} (attach, detach or any)"),
    }
}

#[test]
fn every_answer_in_the_design_table_is_classified_as_the_row_says() {
    let samples = samples();
    let rows = design_table("<!-- classify: answers -->");
    let mut covered = std::collections::BTreeSet::new();
    for row in &rows {
        let [action, answer, next] = &row[..] else {
            panic!("docs/design.md row {row:?} does not have 3 cells");
        };
        let sample = samples.get(answer.as_str()).unwrap_or_else(|| {
            panic!("docs/design.md names an answer the test has no sample of: {answer:?}")
        });
        covered.insert(answer.as_str());
        for a in actions(action) {
            let answers: Vec<Answer<'_>> = match (answer.as_str(), sample) {
                ("200", _) => vec![Answer::Done],
                ("202", _) => vec![Answer::Accepted],
                (_, Some(errors)) => errors.iter().map(Answer::Failed).collect(),
                (_, None) => unreachable!(),
            };
            for ans in &answers {
                let got = classify_answer(a, SERVER, ans).to_string();
                assert_eq!(
                    &got,
                    next,
                    "docs/design.md row ({action} | {answer}) for {}, sample {ans:?}",
                    a.as_str()
                );
            }
        }
    }
    let missing: Vec<_> = samples.keys().filter(|k| !covered.contains(*k)).collect();
    assert!(
        missing.is_empty(),
        "answers without a docs/design.md row: {missing:?}"
    );
}

#[test]
fn refusals_and_running_out_of_time_expand_as_the_design_doc_says() {
    let rows = design_table("<!-- classify: expansions -->");
    for row in &rows {
        let [action, step, earlier, next] = &row[..] else {
            panic!("docs/design.md row {row:?} does not have 4 cells");
        };
        let history = match earlier.as_str() {
            "no" => History::default(),
            "yes" => History {
                earlier: true,
                this: true,
            },
            other => panic!("docs/design.md row says {other:?} (yes or no)"),
        };
        for a in actions(action) {
            let got = match step.split_once(' ') {
                Some(("refuse", reason)) => {
                    let reason = Reason::parse(reason).unwrap_or_else(|| {
                        panic!("docs/design.md names an unknown reason {reason:?}")
                    });
                    refuse(a, history, reason)
                }
                _ if step == "out of time" => out_of_time(a, history),
                _ if step == "retry" => no_resend(a, history).unwrap_or(Next::Retry {
                    why: "",
                    otherwise: Box::new(Next::OutOfTime),
                }),
                _ => panic!("docs/design.md row with step {step:?}"),
            };
            assert_eq!(
                &got.to_string(),
                next,
                "docs/design.md row ({action} | {step} | {earlier}) for {}",
                a.as_str()
            );
        }
    }
}

/// A sample answer to a list or a look at the server, by its cell in the
/// looks table: (status, content type, body).
fn look_sample(cell: &str) -> (u16, &'static str, String) {
    let not_found = |id: &str| {
        format!(
            r#"{{"itemNotFound": {{"code": 404, "message": "Instance {id} could not be found."}}}}"#
        )
    };
    let listed = |volume: &str| {
        format!(
            r#"{{"volumeAttachments": [{{"device": "/dev/vdb", "id": "{volume}", "serverId": "{SERVER}", "volumeId": "{volume}"}}]}}"#
        )
    };
    match cell {
        "200 listing the volume" => (200, JSON, listed(OTHER)),
        "200 not listing it" => (200, JSON, listed("5aa119a8-d25b-45a7-8d1b-88e127885635")),
        "200 this server" => (200, JSON, format!(r#"{{"server": {{"id": "{SERVER}"}}}}"#)),
        "404 naming this server" => (404, JSON, not_found(&SERVER.to_string())),
        "404 naming another server" => (404, JSON, not_found(OTHER)),
        "404 about no server, volume or attachment" => (
            404,
            JSON,
            r#"{"itemNotFound": {"code": 404, "message": "The resource could not be found."}}"#
                .into(),
        ),
        "an answer not Nova's" => (404, "text/html", NGINX_404.into()),
        other => panic!(
            "docs/design.md's looks table names an answer the test has no sample of: {other:?}"
        ),
    }
}

/// What the executor's looks, the reconciler's passes and the verifier
/// read of a list (`Seen::by_list`), with the look at the server that
/// `NovaClient::list_as` makes after a list's 404 naming the server.
// The closures return the adapter's results as the client does (see the
// same allowance in `nova/answer.rs`).
#[allow(clippy::result_large_err)]
#[test]
fn every_look_in_the_design_table_reads_as_the_row_says() {
    for row in design_table("<!-- classify: looks -->") {
        let [list, server, reads] = &row[..] else {
            panic!("docs/design.md row {row:?} does not have 3 cells");
        };
        let (status, ct, body) = look_sample(list);
        let mut listed = read_answer(status, ct, &body, |ex| ex.list(SERVER));
        let asked = matches!(&listed, Err(e) if e.rejection() == Some(&Rejection::ServerNotFound));
        assert_eq!(
            asked,
            server != "not asked",
            "docs/design.md row {row:?}: the server is looked at only after a list's 404 naming it"
        );
        if asked {
            let (status, ct, body) = look_sample(server);
            let look = read_answer(status, ct, &body, |ex| ex.server(SERVER));
            listed = Err(gone_if_shown_gone(listed.unwrap_err(), look));
        }
        let got = match Seen::by_list(&listed, OTHER_ID) {
            Ok(Seen::Attached(_)) => "attached",
            Ok(Seen::Absent) => "absent",
            Ok(Seen::ServerGone) => "server gone",
            Err(_) => "failed",
        };
        assert_eq!(got, reads, "docs/design.md row {row:?}");
    }
}
